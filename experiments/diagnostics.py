"""Spectral and energy diagnostics of p-LaT layers (arXiv 2311.03235, Sections 3-4), per layer and per head.

For a batch of real inputs, every attention layer l of a model is measured on the tensors it actually computes.
A is the layer's softmax kernel softmax(q k^T / sqrt(d)) (causal for the language model; q and k with their rotary
positions in the Llama shape), V a head's value vectors entering the layer (V = LN(h) W_V; with grouped-query
attention, those of the key/value head that the query head reads), p the head's exponent,
P = (D2 + eps)^((p - 2) / 2) its weights, W = A * P, W_off = W off the self pairs, and M the effective matrix of
the head's step (U = M V; paper: M = W; euler: M = W_off + diag(1 - rowsum W_off); noself: W with the self pairs'
P set to 1; selfweight: A with the self pairs' P kept). Every number is a batch mean, one per head: heads with
different p are never summed, because J has the units of ||v||^p.

* ``energy``: eq. 3 with the layer's kernel, J = (1/p) sum_{x != y} A[x, y] (||v_y - v_x||^2 + eps)^(p / 2)
  (eps as in P, so that the p-Laplacian step below is exactly its gradient; the self pairs add nothing).
* ``energy_rate``: d/dtau J(V + tau Delta) / J at tau = 0, with Delta_x = sum_{y != x} W[x, y] (v_y - v_x)
  the direction of the explicit Euler step of the gradient flow (the euler formulation is V + Delta).
  Negative: the step's direction descends J at this point. Theorem 3.4 is about the continuous flow
  dV/dt = -grad J, whose rate is -|grad J|^2 <= 0. Delta is only the part of -grad J that flows through each
  token's own row of A; the whole gradient adds the column part sum_y A[y, x] ..., and the two coincide only
  for a symmetric kernel. So a positive rate is possible, for a causal (triangular) kernel especially, and the
  theorem says nothing about a finite step (tau = 1) or about the eq. 12 step either.
* ``step_energy_ratio``: J(M V) / J(V) for the head's actual step, kernel and p held fixed: below 1 the step
  lowered the energy. An explicit Euler step overshoots when it is too long:
* ``max_offdiag_rowsum``: max_x sum_{y != x} M[x, y], the step length (W_off in every formulation but selfweight,
  whose other tokens keep A; softmax: at most 1; p > 2 heads on spread-out values exceed 1, and past about 2 an
  Euler step overshoots).
* ``attention_hc_dc_gain``: Definition 4.1's high-frequency / DC ratio (DFT along the tokens, norms over
  channels) of U = M V divided by that of V: below 1 the head smooths its input (a low-pass step).
* ``attention_hc_dc_gain_without_self_weight``: the same for M with the self pair's P set to 1, a control
  on the same model: for p < 2 in the paper's (and the selfweight) formulation the self pair weighs
  eps^((p - 2) / 2) (31.6 at p = 1.5, eps = 1e-6), and this separates that self-weight from the weighting of the
  other tokens (euler and noself have no self-weight: the same as the gain itself).
* ``lambda_max_softmax`` / ``lambda_max_effective``: the largest |eigenvalue| of A and of M (Theorems
  4.3-4.4; a row-stochastic A has 1). For a causal kernel the matrices are triangular and their eigenvalues are
  the diagonal: a causal paper-formulation head has lambda_max >= eps^((p - 2) / 2) from its first token,
  a property of eq. 12's self pair rather than of what was learned.
* ``hidden_hc_dc_ratio`` (per model): the HC/DC ratio of the residual stream after each block (entry 0: the
  embeddings; before the final LayerNorm).

Command line::

    python experiments/diagnostics.py --model softmax=runs/softmax --model plat=runs/plat --task image --out diag/
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from modeling_plat.modeling_plat import apply_rotary
from modeling_plat.plap_attention_reference import plap_attention_weights, squared_value_distances
from modeling_plat.plap_dispatch import repeat_kv
from plat_train.arguments import ModelArguments
from plat_train.model_setup import build_config, load_model
from plat_train.presets import image_processor_preset
from plat_train.vision_data import fashion_mnist_files, read_idx

FASHION_MNIST_TEST_IMAGES = str(fashion_mnist_files()["test"][0])
TASKS = {"text": "text-generation", "image": "image-classification"}
PER_HEAD_METRICS = ("energy", "energy_rate", "step_energy_ratio", "max_offdiag_rowsum", "attention_hc_dc_gain",
                    "attention_hc_dc_gain_without_self_weight", "lambda_max_softmax", "lambda_max_effective")


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


def p_dirichlet_energy(features, kernel, p, eps=0.0):
    """Eq. 3 on tokens: J = (1/p) sum_{x != y} k(x,y) (||u(y) - u(x)||^2 + eps)^(p / 2), one value per head.

    features: (..., H, N, d) vectors u; kernel: (..., H, N, N) weights k(x, y) (masked pairs hold 0);
    p: (H,) exponents or a number. Returns (..., H). With eps = 0 this is eq. 3 exactly.
    """
    p = torch.as_tensor(p, dtype=kernel.dtype, device=kernel.device).reshape(-1, 1, 1)  # (H, 1, 1)
    distances = squared_value_distances(features.to(kernel.dtype), features.shape[-2])  # (..., H, N, N)
    off_diagonal = ~torch.eye(features.shape[-2], dtype=torch.bool, device=kernel.device)
    terms = torch.where(off_diagonal, (distances + eps).pow(p / 2), 0.0)
    return (kernel * terms).sum((-1, -2)) / p[..., 0, 0]


def largest_abs_eigenvalue(matrices):
    """max_i |lambda_i| of each (..., N, N) matrix, in float64: the spectral radius of Theorems 4.3-4.4."""
    return torch.linalg.eigvals(matrices.to(torch.float64)).abs().amax(-1)


# --- Measuring a model -------------------------------------------------------------------------------------


def head_inputs(attention, hidden, position_embeddings=None):
    """(query, key, value) of every query head, each (B, H, N, d), as ``attention`` computes them from ``hidden``:
    rotary positions on queries and keys when given ((cos, sin), the Llama shape), and each key/value head
    repeated for the query heads it serves (grouped-query attention)."""
    batch, length, _ = hidden.shape

    def heads(projection):
        return projection(hidden).view(batch, length, -1, attention.head_dim).transpose(1, 2)  # (B, H | H_kv, N, d)

    query, key, value = heads(attention.q_proj), heads(attention.k_proj), heads(attention.v_proj)
    if position_embeddings is not None:
        query, key = apply_rotary(query, *position_embeddings), apply_rotary(key, *position_embeddings)
    repeats = attention.num_heads // attention.num_kv_heads
    return query, repeat_kv(key, repeats), repeat_kv(value, repeats)  # (B, H, N, d)


def euler_direction(weights, value):
    """Delta_x = sum_{y != x} W[x, y] (v_y - v_x): the explicit Euler step's direction, (..., N, d)."""
    off = weights * ~torch.eye(weights.shape[-1], dtype=torch.bool, device=weights.device)
    return off @ value - off.sum(-1, keepdim=True) * value


def energy_rate(value, kernel, p, eps, direction):
    """d/dtau J(V + tau direction) / J(V) at tau = 0, by automatic differentiation; (..., H)."""
    value = value.detach().requires_grad_(True)
    with torch.enable_grad():
        energy = p_dirichlet_energy(value, kernel, p, eps)
        (gradient,) = torch.autograd.grad(energy.sum(), value)
    return (gradient * direction).sum((-1, -2)) / energy.detach()


def head_matrices(attention, hidden, attn_mask=None, position_embeddings=None):
    """(A, W, M, V) of one ``PlatAttention`` fed ``hidden`` (the normalised block input, (B, N, D)): the softmax
    kernel, W = A * P with the p-Laplacian P of every pair, the effective matrix M of the layer's formulation
    (each (B, H, N, N)), and the values (B, H, N, d)."""
    query, key, value = head_inputs(attention, hidden, position_embeddings)
    p = torch.tensor(attention.p_values, device=hidden.device)
    config = attention.config

    def weights_of(exponents, formulation):
        return plap_attention_weights(query, key, value, exponents, attn_mask=attn_mask,
                                      is_causal=attention.is_causal, eps=config.plap_eps, formulation=formulation)

    # p = 2 makes P = 1 exactly: the layer's own softmax kernel with its own masking.
    softmax_kernel = weights_of(torch.full_like(p, 2.0), "paper")
    weights = weights_of(p, "paper")  # A * P, (B, H, N, N)
    effective = weights if config.plap_formulation == "paper" else weights_of(p, config.plap_formulation)
    return softmax_kernel, weights, effective, value.to(weights.dtype)


def attention_diagnostics(attention, hidden, attn_mask=None, position_embeddings=None):
    """Per-head metrics of one ``PlatAttention`` fed ``hidden`` (the normalised block input, (B, N, D)) and, in the
    Llama shape, the rotary ``position_embeddings`` (cos, sin) of its tokens.

    Returns a dict of (H,) tensors, batch means; see the module docstring for their definitions.
    """
    softmax_kernel, weights, effective, value = head_matrices(attention, hidden, attn_mask, position_embeddings)
    p = torch.tensor(attention.p_values, device=hidden.device)
    config = attention.config
    self_pairs = torch.eye(weights.shape[-1], dtype=torch.bool, device=weights.device)
    output = effective @ value  # (B, H, N, d)
    # The step with the self pair's P replaced by 1: what the other tokens' weights alone do. The Euler step has no
    # self pair's P (its diagonal is 1 - the row sum): the same step.
    without_self_weight = effective if config.plap_formulation == "euler" \
        else torch.where(self_pairs, softmax_kernel, effective)
    direction = euler_direction(weights, value)
    value_ratio = hc_dc_ratio(value)
    return {
        "energy": p_dirichlet_energy(value, softmax_kernel, p, config.plap_eps).mean(0),
        "energy_rate": energy_rate(value, softmax_kernel, p, config.plap_eps, direction).mean(0),
        "step_energy_ratio": (p_dirichlet_energy(output, softmax_kernel, p, config.plap_eps)
                              / p_dirichlet_energy(value, softmax_kernel, p, config.plap_eps)).mean(0),
        "max_offdiag_rowsum": torch.where(self_pairs, 0.0, effective).sum(-1).amax(-1).mean(0),
        "attention_hc_dc_gain": (hc_dc_ratio(output) / value_ratio).mean(0),
        "attention_hc_dc_gain_without_self_weight": (hc_dc_ratio(without_self_weight @ value) / value_ratio).mean(0),
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

    Hooks record what each block receives (residual stream, then its normalised attention input, mask and rotary
    positions) while the model runs once; the per-layer metrics are then computed from those tensors.
    """
    layers = _trunk(model).layers
    stream, attention_inputs = [], []

    def record_block_input(module, args):
        if not stream:
            stream.append(args[0])

    def record_block_output(module, args, output):
        stream.append(output[0])

    def record_attention_input(module, args):
        # PlatLayer passes (hidden, attn_mask, past_key_values, output_attentions, position_embeddings, ...).
        attention_inputs.append((args[0], args[1] if len(args) > 1 else None, args[4] if len(args) > 4 else None))

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
    for index, (layer, (hidden, attn_mask, position_embeddings)) in enumerate(zip(layers, attention_inputs)):
        metrics = attention_diagnostics(layer.attention, hidden, attn_mask, position_embeddings)
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
    else resized to the model's size and normalised as the Fashion-MNIST preset is."""
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
        statistics = image_processor_preset("plat-fmnist-tiny")
        pixels = (pixels - statistics["image_mean"][0]) / statistics["image_std"][0]
    if pixels.shape[1] != config.num_channels:
        raise ValueError(f"The image processor of {model_path} gives {pixels.shape[1]} channels; the model "
                         f"expects {config.num_channels}")
    return {"pixel_values": pixels}


# --- Reports ---------------------------------------------------------------------------------------------


# (metric, axis label, scale, reference line) of the per-head figure, one row each.
HEAD_PLOTS = (
    ("energy_rate", "dJ/dtau / J along the Euler direction\n(< 0: the direction descends J)", "symlog", 0.0),
    ("step_energy_ratio", "J(M V) / J(V)\n(< 1: the step lowers J)", "log", 1.0),
    ("max_offdiag_rowsum", "largest off-diagonal row sum\nof A * P (step length)", "log", 1.0),
    ("attention_hc_dc_gain", "HC/DC gain of the step\n(< 1: low-pass)", "log", 1.0),
    ("attention_hc_dc_gain_without_self_weight", "HC/DC gain, the self pair's\nP set to 1", "log", 1.0),
    ("lambda_max_effective", "largest |eigenvalue| of M\n(softmax: 1)", "log", 1.0),
)
P_COLORS = {1.5: "tab:blue", 2.0: "tab:gray", 2.5: "tab:orange"}


def group_runs(results):
    """{group: [result, ...]}: models named ``group/seedK`` share a group (their seeds), others stand alone."""
    groups = {}
    for name, result in results.items():
        groups.setdefault(name.split("/")[0], []).append(result)
    return groups


def summary_by_p(results):
    """{group: {p: {metric: (median, min, max)}}} over every layer, head of that p and seed of each group."""
    summary = {}
    for group, runs in group_runs(results).items():
        values = {}
        for run in runs:
            for layer in run["layers"]:
                for head, p in enumerate(layer["p"]):
                    for metric in PER_HEAD_METRICS:
                        values.setdefault(p, {}).setdefault(metric, []).append(layer[metric][head])
        summary[group] = {p: {metric: (float(np.median(v)), float(np.min(v)), float(np.max(v)))
                              for metric, v in metrics.items()} for p, metrics in sorted(values.items())}
    return summary


def per_head(runs, metric, head):
    """(seeds, layers) array of one head's metric."""
    return np.array([[layer[metric][head] for layer in run["layers"]] for run in runs])


def plot_all(results, out_dir):
    """Two PNGs: every per-head metric by layer, one column per model group (mean over its seeds, bars: the
    smallest and largest seed); and the residual stream's HC/DC ratio by layer. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    groups = group_runs(results)
    fig, axes = plt.subplots(len(HEAD_PLOTS), len(groups), figsize=(3.6 * len(groups) + 1, 2.4 * len(HEAD_PLOTS)),
                             squeeze=False, sharey="row")
    for column, (group, runs) in enumerate(groups.items()):
        layers = np.arange(1, len(runs[0]["layers"]) + 1)
        p_of_heads = runs[0]["layers"][0]["p"]
        for row, (metric, label, scale, reference) in enumerate(HEAD_PLOTS):
            ax = axes[row][column]
            for head, p in enumerate(p_of_heads):
                values = per_head(runs, metric, head)
                shift = (head - (len(p_of_heads) - 1) / 2) * 0.04  # heads side by side
                mean = values.mean(0)
                ax.errorbar(layers + shift, mean, yerr=[mean - values.min(0), values.max(0) - mean], marker="o",
                            ms=3, lw=0.8, capsize=2, color=P_COLORS.get(p, "tab:purple"), alpha=0.8)
            ax.axhline(reference, color="grey", lw=0.8, ls=":")
            ax.set_yscale(scale)
            if column == 0:
                ax.set_ylabel(label, fontsize=8)
            if row == 0:
                ax.set_title(f"{group} ({len(runs)} model{'s' * (len(runs) > 1)})", fontsize=9)
            if row == len(HEAD_PLOTS) - 1:
                ax.set_xlabel("layer")
    handles = [Line2D([], [], color=color, marker="o", label=f"p = {p}") for p, color in P_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=8)
    paths = [_save(fig, out_dir / "heads.png")]

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for group, runs in groups.items():
        ratios = np.array([run["hidden_hc_dc_ratio"] for run in runs])
        ax.errorbar(range(ratios.shape[1]), ratios.mean(0), yerr=[ratios.mean(0) - ratios.min(0),
                                                                  ratios.max(0) - ratios.mean(0)],
                    marker="o", capsize=3, label=group)
    ax.set(xlabel="layer (0 = embeddings, l = output of block l)", ylabel="||HC|| / ||DC||", yscale="log",
           title="Residual stream: high-frequency / DC ratio")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "residual_hc_dc.png"))
    return paths


def _save(fig, path):
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
