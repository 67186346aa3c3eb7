"""Model cards (README.md) of saved and pushed p-LaT checkpoints, built on huggingface_hub's ModelCard.

The metadata carries ``model-index`` (so the Hub shows the evaluation results), the license, dataset ids,
``library_name: transformers`` and the pipeline tag; the body the architecture with p per head, the results,
the training command and hyperparameters, framework versions and a usage snippet that runs as printed
(tested) on a machine with transformers alone.
"""

import importlib.metadata
import shlex
import sys
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

# Hub ids of the data sets the jobs read offline by default.
PTB_DATASET = "ptb-text-only/ptb_text_only"
FASHION_MNIST_DATASET = "zalando-datasets/fashion_mnist"
DEFAULT_LICENSE = "apache-2.0"

USAGE = {
    "text-generation": '''from transformers import pipeline

generator = pipeline("text-generation", model="{model_id}", trust_remote_code=True)
print(generator("{prompt}", max_new_tokens=20, do_sample=False)[0]["generated_text"])''',
    "image-classification": '''from PIL import Image
from transformers import pipeline

classifier = pipeline("image-classification", model="{model_id}", trust_remote_code=True)
image = Image.new("{mode}", ({size}, {size}))  # replace with Image.open("your-image.png")
print(classifier(image))''',
}
# (metric key suffix, model-index metric type, readable name) of the quality metrics a card reports.
QUALITY_METRICS = (
    ("sliding_perplexity", "perplexity", "Perplexity (sliding window)"),
    ("perplexity", "perplexity", "Perplexity"),
    ("accuracy", "accuracy", "Token accuracy"),
    ("top1_accuracy", "accuracy", "Top-1 accuracy"),
    ("top5_accuracy", "top_5_accuracy", "Top-5 accuracy"),
)
SPLITS = {"test": "test", "eval": "validation"}
FRAMEWORKS = ("plat-transformers", "transformers", "torch", "datasets", "tokenizers")


def _shape_line(config, task):
    """One line naming the block shape: GPT-2-style or Llama-style decoder (with GQA when it has it), or ViT."""
    if task != "text-generation":
        return "ViT-style encoder: patches, a [CLS] token, learned positions, pre-LayerNorm blocks, GELU MLP."
    num_kv_heads, _ = config.head_shape()
    rope = config.position_embedding_type == "rope"
    style = "Llama-style" if rope else "GPT-2-style"
    attention = (f"GQA ({config.num_attention_heads} query heads over {num_kv_heads} key/value heads)"
                 if num_kv_heads < config.num_attention_heads else "multi-head attention")
    positions = f"rotary positions (theta {config.rope_parameters['rope_theta']:g})" if rope else "learned positions"
    norm = "RMSNorm" if config.norm_type == "rmsnorm" else "LayerNorm"
    mlp = f"gated {config.hidden_act} MLP" if config.mlp_type == "gated" else f"{config.hidden_act} MLP"
    return f"{style} decoder, {attention}: {positions}, pre-{norm} blocks, {mlp}."


def _architecture_lines(config, task):
    rows = [
        ("layers", config.num_hidden_layers),
        ("hidden size", config.hidden_size),
        ("attention heads", config.num_attention_heads),
        ("key/value heads", config.head_shape()[0]),
        ("MLP size", config.intermediate_size),
    ]
    if task == "text-generation":
        rows += [("vocabulary", config.vocab_size), ("context", config.max_position_embeddings)]
    else:
        rows += [("image size", config.image_size), ("patch size", config.patch_size),
                 ("channels", config.num_channels), ("labels", config.num_labels)]
    rows += [("formulation", config.plap_formulation), ("eps", config.plap_eps)]
    table = ["| setting | value |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    per_layer = config.p_per_layer()
    if all(row == per_layer[0] for row in per_layer):
        p_text = f"p per head (all layers): {per_layer[0]}"
    else:
        p_text = "p per layer and head:\n\n" + "\n".join(f"- layer {i}: {row}" for i, row in enumerate(per_layer))
    return _shape_line(config, task) + "\n\n" + "\n".join(table) + "\n\n" + p_text


def _format(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def quality_metrics(metrics):
    """(split, suffix, model-index type, name, value) of the quality metrics in ``metrics``, test split first.

    Run times, throughputs, FLOPs and counts say nothing about the model and are left out.
    """
    found = []
    for prefix, split in SPLITS.items():
        for suffix, metric_type, name in QUALITY_METRICS:
            value = (metrics or {}).get(f"{prefix}_{suffix}")
            if isinstance(value, (int, float)):
                found.append((split, suffix, metric_type, name, value))
    return found


def framework_versions():
    versions = {}
    for package in FRAMEWORKS:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def model_card(config, task, model_id, metrics=None, dataset=None, command=None, base_model=None,
               hyperparameters=None, license=DEFAULT_LICENSE, prompt="the"):
    """The ``huggingface_hub.ModelCard`` of a p-LaT checkpoint.

    ``dataset`` is a Hub dataset id (``None`` for local files); ``metrics`` the job's ``all_results.json``;
    ``hyperparameters`` a mapping (Trainer's, see ``trainers.PlatModelCardMixin``).
    """
    if task not in USAGE:
        raise ValueError(f"task must be one of {sorted(USAGE)}; got {task!r}")
    name = Path(str(model_id)).name
    found = quality_metrics(metrics)
    eval_results = [
        EvalResult(task_type=task, dataset_type=dataset, dataset_name=dataset, dataset_split=split,
                   metric_type=metric_type, metric_name=metric_name, metric_value=float(value))
        for split, _, metric_type, metric_name, value in found
    ] if dataset else None
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=task,
        tags=["p-laplacian-transformer", "plat", task],
        license=license,
        datasets=[dataset] if dataset else None,
        metrics=sorted({metric_type for _, _, metric_type, _, _ in found}) or None,
        base_model=base_model,
        model_name=name,
        eval_results=eval_results,
    )
    usage = USAGE[task].format(model_id=model_id, prompt=prompt, size=getattr(config, "image_size", 0),
                               mode="L" if getattr(config, "num_channels", 3) == 1 else "RGB")
    sections = [
        f"# {name}",
        "A p-Laplacian Transformer (p-LaT, [arXiv 2311.03235](https://arxiv.org/abs/2311.03235)): softmax "
        "attention re-weighted by P[x, y] = (||v_x - v_y||^2 + eps)^((p - 2) / 2), one p per head "
        "(p = 2 is softmax attention)." + (f" Converted from `{base_model}`." if base_model else ""),
        "## Architecture\n\n" + _architecture_lines(config, task),
    ]
    if found:
        rows = "\n".join(f"| {split} | {metric_name} | {_format(value)} |"
                         for split, _, _, metric_name, value in found)
        sections.append("## Evaluation results\n\n" + (f"Data: `{dataset}`\n\n" if dataset else "")
                        + "| split | metric | value |\n|---|---|---|\n" + rows)
    if command:
        sections.append("## Training command\n\n```bash\n" + command + "\n```")
    if hyperparameters:
        sections.append("## Training hyperparameters\n\n"
                        + "\n".join(f"- {key}: {value}" for key, value in hyperparameters.items()))
    sections.append("## Framework versions\n\n"
                    + "\n".join(f"- {package} {version}" for package, version in framework_versions().items()))
    sections.append(
        "## Usage\n\nThe modeling code ships with the checkpoint (`trust_remote_code=True`); with the "
        "`plat-transformers` package installed, `import modeling_plat` registers the classes instead.\n\n"
        "```python\n" + usage + "\n```"
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


# The Auto class that loads a model of each task.
AUTO_CLASSES = {"text-generation": "AutoModelForCausalLM", "image-classification": "AutoModelForImageClassification"}


def plap_interface_section(config, model_id, task):
    """The model card section of a transformers model that runs p-LaT through attn_implementation="plap"."""
    p = getattr(config, "plap_p", None)
    auto_class = AUTO_CLASSES[task]
    return (
        "## p-LaT attention\n\n"
        f"This {type(config).__name__.removesuffix('Config')} model runs p-Laplacian attention (p-LaT, "
        "[arXiv 2311.03235](https://arxiv.org/abs/2311.03235)) in every attention layer, with p per head "
        f"{'the paper mix (1.5 and 2.5)' if p is None else p}, eps {getattr(config, 'plap_eps', 1e-6)} and "
        f"the {getattr(config, 'plap_formulation', 'paper')!r} formulation (config.json's `plap_*` fields). Its "
        "config.json says `\"attn_implementation\": \"plap\"`, which the `plat-transformers` package registers "
        "with transformers: load it after importing it (without it, transformers refuses the checkpoint rather "
        "than run softmax attention).\n\n"
        "```python\nimport modeling_plat  # pip install plat-transformers\nfrom transformers import "
        f"{auto_class}\n\nmodel = {auto_class}.from_pretrained(\"{model_id}\", "
        "attn_implementation=\"plap\")\n```\n"
    )


def write_model_card(output_dir, config, task, model_id=None, **kwargs):
    """Write ``output_dir/README.md``; ``model_id`` defaults to the folder itself (usable as printed)."""
    output_dir = Path(output_dir)
    path = output_dir / "README.md"
    model_card(config, task, model_id or str(output_dir.resolve()), **kwargs).save(path)
    return path


def current_command():
    """The command line that started this process, shell-quoted."""
    return " ".join(shlex.quote(arg) for arg in ["python", *sys.argv])
