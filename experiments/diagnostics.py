"""Spectral and energy diagnostics of p-LaT layers (arXiv 2311.03235, Sections 3-4), per layer and head.

For a batch of real inputs, every attention layer l of a model is measured on the tensors it actually computes:

* ``hidden_hc_dc_ratio``: Definition 4.1's high-frequency / DC ratio of the residual stream, token axis
  transformed by the DFT channel by channel, norms taken over all channels (Frobenius, as in Wang et al.
  2022): ``||HC[X]|| / ||DC[X]||``. Entry 0 is the embeddings, entry l the output of block l (before the
  final LayerNorm). A low-pass stack drives it towards 0 with depth.
* ``attention_hc_dc_gain``: the same ratio of one head's attention output U = M V divided by that of its
  values V: below 1 the head smooths its input (a low-pass step), above 1 it sharpens it.
* ``energy``: eq. 3 discretised with the layer's own kernel,
  ``J = (1/p) sum_{x,y} k(x,y) ||v(y) - v(x)||^p``, where v are the head's value vectors entering layer l
  (V = LN(h) W_V, the features the layer's p-Laplacian acts on), k(x, y) is the layer's softmax kernel
  A = softmax(q k^T / sqrt(d)) (causal for the language model, rows sum to 1) and p is the head's p.
  Summed over token pairs, averaged over the batch. Comparing it across layers is Theorem 3.4's
  "J(U^l) >= J(U^{l+1})" read with each layer's own features and kernel.
* ``energy_after_step``: the same functional, same kernel and p, of the attention output U = M V. One
  attention step is the paper's (simplified) Euler step of the gradient flow of this J, so Theorem 3.4 claims
  ``energy_after_step <= energy`` layer by layer without the MLP, residual and new projections in between.
* ``lambda_max_softmax`` / ``lambda_max_effective``: the largest |eigenvalue| of A and of the effective
  matrix M (paper formulation: A ⊙ P; euler: its Euler-step matrix), Theorems 4.3-4.4: a row-stochastic
  A has 1; M with lambda_max > 1 (and 1 not its Perron vector) is not a low-pass filter. For a causal A
  the matrices are lower triangular, so the eigenvalues are the diagonal, the self-weights: the first
  token has A[0, 0] = 1, so a causal paper-formulation head has lambda_max >= P[0, 0] = eps^((p - 2) / 2)
  (31.6 for p = 1.5 and the default eps), a property of eq. 12's diagonal rather than of what was learned.

Every number is a batch mean. Command line::

    python experiments/diagnostics.py --model softmax=runs/softmax --model plat=runs/plat --task image --out diag/
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from modeling_plat.plap_attention import plap_attention_weights, squared_value_distances
from plat_train.arguments import ModelArguments
from plat_train.model_setup import build_config, load_model
from plat_train.vision_data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, fashion_mnist_files, read_idx

FASHION_MNIST_TEST_IMAGES = str(fashion_mnist_files()["test"][0])
TASKS = {"text": "text-generation", "image": "image-classification"}
PER_HEAD_METRICS = ("energy", "energy_after_step", "attention_hc_dc_gain", "lambda_max_softmax",
                    "lambda_max_effective")


# --- The maths: tensors in, tensors out -------------------------------------------------------------------


def hc_dc_ratio(features):
    """||HC|| / ||DC|| of (..., N, D) features over the token axis N (Definition 4.1); returns (...).

    The DFT runs along N for every channel; the DC component is the first Fourier coefficient, HC all the
    others, and both norms sum over the channels. With the unitary DFT, ||DC[z]|| = |z~_0| (Parseval).
    A constant signal gives 0; a signal with zero mean gives inf.
    """
    spectrum = torch.fft.fft(features.to(torch.promote_types(features.dtype, torch.float32)), dim=-2, norm="ortho")
    dc = spectrum[..., 0, :].abs().pow(2).sum(-1)  # (...)
    hc = spectrum[..., 1:, :].abs().pow(2).sum((-1, -2))  # (...)
    return (hc / dc).sqrt()


def p_dirichlet_energy(features, kernel, p):
    """Eq. 3 on tokens: J = (1/p) sum_{x,y} k(x,y) ||u(y) - u(x)||^p, one value per head.

    features: (..., H, N, d) vectors u; kernel: (..., H, N, N) weights k(x, y) (masked pairs hold 0);
    p: (H,) exponents or a number. Returns (..., H).
    """
    p = torch.as_tensor(p, dtype=kernel.dtype, device=kernel.device).reshape(-1, 1, 1)  # (H, 1, 1)
    distances = squared_value_distances(features.to(kernel.dtype), features.shape[-2])  # (..., H, N, N)
    return (kernel * distances.pow(p / 2)).sum((-1, -2)) / p[..., 0, 0]


def largest_abs_eigenvalue(matrices):
    """max_i |lambda_i| of each (..., N, N) matrix, in float64: the spectral radius of Theorems 4.3-4.4."""
    return torch.linalg.eigvals(matrices.to(torch.float64)).abs().amax(-1)


# --- Measuring a model -------------------------------------------------------------------------------------


def _heads(projection, hidden, num_heads):
    batch, length, _ = hidden.shape
    return projection(hidden).view(batch, length, num_heads, -1).transpose(1, 2)  # (B, H, N, d)


def attention_diagnostics(attention, hidden, attn_mask=None):
    """Per-head metrics of one ``PlatAttention`` fed ``hidden`` (the normalised block input, (B, N, D)).

    Returns a dict of (H,) tensors, batch means; see the module docstring for their definitions.
    """
    num_heads = attention.num_heads
    query, key, value = (_heads(proj, hidden, num_heads) for proj in (attention.q_proj, attention.k_proj,
                                                                     attention.v_proj))
    p = attention.plap_p(hidden.device)
    config = attention.config
    # p = 2 makes P = 1 exactly, so this is the layer's own softmax kernel with the layer's own masking.
    softmax_kernel = plap_attention_weights(query, key, value, torch.full_like(p, 2.0), attn_mask,
                                            attention.is_causal, config.plap_eps, "paper")
    effective = plap_attention_weights(query, key, value, p, attn_mask, attention.is_causal, config.plap_eps,
                                       config.plap_formulation)
    value = value.to(effective.dtype)
    output = effective @ value  # (B, H, N, d)
    return {
        "energy": p_dirichlet_energy(value, softmax_kernel, p).mean(0),
        "energy_after_step": p_dirichlet_energy(output, softmax_kernel, p).mean(0),
        "attention_hc_dc_gain": (hc_dc_ratio(output) / hc_dc_ratio(value)).mean(0),
        "lambda_max_softmax": largest_abs_eigenvalue(softmax_kernel).mean(0),
        "lambda_max_effective": largest_abs_eigenvalue(effective).mean(0),
    }


def _trunk(model):
    trunk = model.base_model
    if not hasattr(trunk, "layers"):
        raise ValueError(f"{type(model).__name__} has no p-LaT layers to measure")
    return trunk


@torch.no_grad()
def diagnose(model, inputs):
    """All diagnostics of ``model`` on one batch: ``inputs`` are the model's keyword arguments.

    Hooks record what each block receives (residual stream, then its normalised attention input and mask)
    while the model runs once; the per-layer metrics are then computed from those tensors.
    """
    layers = _trunk(model).layers
    stream, attention_inputs = [], []

    def record_block_input(module, args):
        if not stream:
            stream.append(args[0])

    def record_block_output(module, args, output):
        stream.append(output[0])

    def record_attention_input(module, args):
        attention_inputs.append((args[0], args[1] if len(args) > 1 else None))

    handles = [layers[0].register_forward_pre_hook(record_block_input)]
    for layer in layers:
        handles.append(layer.register_forward_hook(record_block_output))
        handles.append(layer.attention.register_forward_pre_hook(record_attention_input))
    try:
        model.eval()
        model(**inputs)
    finally:
        for handle in handles:
            handle.remove()

    per_layer = []
    for index, (layer, (hidden, attn_mask)) in enumerate(zip(layers, attention_inputs)):
        metrics = attention_diagnostics(layer.attention, hidden, attn_mask)
        per_layer.append({"layer": index, "p": list(layer.attention.p_values),
                          **{name: metrics[name].tolist() for name in PER_HEAD_METRICS}})
    return {
        "formulation": model.config.plap_formulation,
        "hidden_hc_dc_ratio": [hc_dc_ratio(h).mean().item() for h in stream],
        "layers": per_layer,
    }


# --- Loading models and inputs -----------------------------------------------------------------------------


def load_checkpoint(path, task):
    """A p-LaT checkpoint, or a transformers GPT-2 / ViT one converted with p = 2 (its softmax baseline)."""
    from transformers import AutoConfig

    overrides = None if AutoConfig.from_pretrained(path).model_type.startswith("plat") else "plap_p=2.0"
    model_args = ModelArguments(model_name_or_path=str(path), config_overrides=overrides)
    return load_model(model_args, build_config(model_args, TASKS[task]), TASKS[task]).eval()


def text_batch(model_path, config, inputs_file, batch_size, block_size):
    """``batch_size`` consecutive blocks of ``block_size`` tokens from a text file (one text per line) or,
    by default, the start of the Penn Treebank validation split, tokenised by the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    from plat_train import text_data

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    block_size = min(block_size, config.max_position_embeddings)
    if inputs_file is None:
        texts = text_data.load_penn_treebank()["validation"]["text"]
    else:
        texts = Path(inputs_file).read_text().splitlines()
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    needed, ids = batch_size * block_size, []
    for text in texts:  # every line holds at least its end-of-sequence token
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise ValueError(f"{inputs_file or 'PTB validation'} has {len(ids)} tokens, fewer than "
                         f"{batch_size} blocks of {block_size}: pass a smaller --batch_size or --block_size")
    return {"input_ids": torch.tensor(ids[:needed]).view(batch_size, block_size), "use_cache": False}


def image_batch(model_path, config, inputs_file, batch_size):
    """The first ``batch_size`` test images, preprocessed by the checkpoint's image processor when it has one,
    else resized to the model's size and normalised with Fashion-MNIST's statistics."""
    from PIL import Image
    from transformers import AutoImageProcessor

    mode = "L" if config.num_channels == 1 else "RGB"
    images = [Image.fromarray(a).convert(mode)
              for a in read_idx(inputs_file or FASHION_MNIST_TEST_IMAGES, batch_size)]
    try:
        processor = AutoImageProcessor.from_pretrained(model_path, trust_remote_code=True)
    except (OSError, ValueError):
        processor = None
    if processor is not None:
        pixels = processor(images, return_tensors="pt").pixel_values
    else:
        size = (config.image_size, config.image_size)
        arrays = [np.asarray(image.resize(size, Image.BICUBIC), dtype=np.float32) / 255 for image in images]
        pixels = torch.from_numpy(np.stack(arrays))  # (B, H, W) or (B, H, W, 3)
        pixels = pixels[:, None] if mode == "L" else pixels.permute(0, 3, 1, 2)
        pixels = (pixels - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0]
    if pixels.shape[1] != config.num_channels:
        raise ValueError(f"The image processor of {model_path} gives {pixels.shape[1]} channels; the model "
                         f"expects {config.num_channels}")
    return {"pixel_values": pixels}


# --- Reports ---------------------------------------------------------------------------------------------


def _layer_curve(result, metric, reduce):
    return [reduce(layer[metric]) for layer in result["layers"]]


def plot_all(results, out_dir):
    """Three PNGs, layer on x, one line per model: HC/DC ratio, energy, largest eigenvalues. Their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colors = dict(zip(results, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results.items():
        ratio = result["hidden_hc_dc_ratio"]
        axes[0].plot(range(len(ratio)), ratio, "o-", color=colors[name], label=name)
        gains = _layer_curve(result, "attention_hc_dc_gain", np.mean)
        axes[1].plot(range(1, len(gains) + 1), gains, "o-", color=colors[name], label=name)
    axes[0].set(xlabel="layer (0 = embeddings, l = output of block l)", ylabel="||HC|| / ||DC||", yscale="log",
                title="Residual stream: high-frequency / DC ratio")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[1].set(xlabel="layer", ylabel="ratio(M V) / ratio(V), mean over heads", yscale="log",
                title="Attention step: HC/DC gain (< 1: low-pass)")
    axes[0].legend()
    paths.append(_save(fig, out_dir / "hc_dc_ratio.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results.items():
        energy = _layer_curve(result, "energy", sum)
        after = _layer_curve(result, "energy_after_step", sum)
        layers = range(1, len(energy) + 1)
        axes[0].plot(layers, energy, "o-", color=colors[name], label=name)
        axes[1].plot(layers, [a / b for a, b in zip(after, energy)], "o-", color=colors[name], label=name)
    axes[0].set(xlabel="layer", ylabel="J(V^l), summed over heads", yscale="log",
                title="Energy (eq. 3) of the values entering each layer")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[1].set(xlabel="layer", ylabel="J(M V) / J(V), same kernel and p", yscale="log",
                title="One attention step (< 1: energy decreases)")
    axes[0].legend()
    paths.append(_save(fig, out_dir / "energy.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, result in results.items():
        layers = np.arange(1, len(result["layers"]) + 1)
        ax.plot(layers, _layer_curve(result, "lambda_max_effective", np.mean), "o-", color=colors[name],
                label=f"{name}: M (mean over heads)")
        for layer, values in zip(layers, _layer_curve(result, "lambda_max_effective", list)):
            ax.scatter([layer] * len(values), values, s=10, color=colors[name], alpha=0.5)
        ax.plot(layers, _layer_curve(result, "lambda_max_softmax", np.mean), "x--", color=colors[name],
                label=f"{name}: A")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="layer", ylabel="largest |eigenvalue|", yscale="log",
           title="Spectral radius: A vs effective matrix M (dots: heads)")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "spectrum.png"))
    return paths


def _save(fig, path):
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def name_models(specs):
    """``NAME=PATH`` or ``PATH`` strings -> {name: path}; a bare path is named by its folder, made unique."""
    named = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).resolve().name or spec, spec
        unique, suffix = name, 2
        while unique in named:
            unique, suffix = f"{name}-{suffix}", suffix + 1
        named[unique] = path
    return named


def run(models, task, out_dir, inputs_file=None, batch_size=16, block_size=128):
    """Diagnose every model of ``models`` ({name: checkpoint path}) on the same inputs; write
    ``diagnostics.json`` and the PNGs into ``out_dir``. Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, path in models.items():
        model = load_checkpoint(path, task)
        if task == "text":
            batch = text_batch(path, model.config, inputs_file, batch_size, block_size)
        else:
            batch = image_batch(path, model.config, inputs_file, batch_size)
        tokens = next(iter(batch.values())).shape
        results[name] = {"path": str(path), "input_shape": list(tokens), **diagnose(model, batch)}
    report = {
        "task": task,
        "inputs": inputs_file or ("PTB validation" if task == "text" else FASHION_MNIST_TEST_IMAGES),
        "batch_size": batch_size,
        "definitions": __doc__,
        "models": results,
    }
    (out_dir / "diagnostics.json").write_text(json.dumps(report, indent=2, allow_nan=True))
    return [out_dir / "diagnostics.json", *plot_all(results, out_dir)]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python experiments/diagnostics.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                        help="a saved p-LaT checkpoint, or a GPT-2 / ViT one (measured as p = 2); repeat to "
                             "compare; NAME labels it in the JSON and plots (default: the folder name)")
    parser.add_argument("--task", choices=["text", "image"], required=True)
    parser.add_argument("--inputs", default=None,
                        help="text: a .txt file, one text per line (default: PTB validation); "
                             f"image: an idx3 gzip file (default: {FASHION_MNIST_TEST_IMAGES})")
    parser.add_argument("--out", required=True, help="folder for diagnostics.json and the PNGs")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=128, help="text: tokens per sequence (at most the "
                                                                     "model's max_position_embeddings)")
    args = parser.parse_args(argv)
    for path in run(name_models(args.model), args.task, args.out, args.inputs, args.batch_size, args.block_size):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
