"""Model cards (README.md with YAML metadata) for saved and pushed p-LaT checkpoints."""

import json
import shlex
import sys
from pathlib import Path

import yaml
from transformers import GenerationMixin, Trainer

from modeling_plat import PlatConfig

PIPELINE_TAGS = {"text-generation": "text-generation", "image-classification": "image-classification"}

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


def _architecture_lines(config, task):
    rows = [
        ("layers", config.num_hidden_layers),
        ("hidden size", config.hidden_size),
        ("attention heads", config.num_attention_heads),
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
    return "\n".join(table) + "\n\n" + p_text


def _format(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def model_card_text(config, task, model_id, metrics=None, dataset=None, command=None, base_model=None, prompt="the"):
    """The README.md text of a p-LaT checkpoint."""
    if task not in PIPELINE_TAGS:
        raise ValueError(f"task must be one of {sorted(PIPELINE_TAGS)}; got {task!r}")
    # Quality metrics only: run times, throughputs, FLOPs and counts say nothing about the model.
    bookkeeping = ("runtime", "per_second", "flos", "epoch", "samples", "tokens", "stride")
    metrics = {name: value for name, value in (metrics or {}).items()
               if not any(part in name for part in bookkeeping)}
    metadata = {
        "library_name": "transformers",
        "pipeline_tag": PIPELINE_TAGS[task],
        "tags": ["p-laplacian-transformer", "plat", task],
    }
    if dataset:
        metadata["datasets"] = [dataset]
    metric_names = sorted({name.split("_", 1)[-1] for name in metrics if "_" in name})
    if metric_names:
        metadata["metrics"] = metric_names
    if base_model:
        metadata["base_model"] = base_model
    size = config.image_size
    usage = USAGE[task].format(model_id=model_id, prompt=prompt, size=size, mode="L" if config.num_channels == 1 else "RGB")
    sections = [
        "---\n" + yaml.safe_dump(metadata, sort_keys=False) + "---",
        f"# {Path(str(model_id)).name}",
        "A p-Laplacian Transformer (p-LaT, [arXiv 2311.03235](https://arxiv.org/abs/2311.03235)): softmax "
        "attention re-weighted by P[x, y] = (||v_x - v_y||^2 + eps)^((p - 2) / 2), one p per head "
        "(p = 2 is softmax attention)." + (f" Converted from `{base_model}`." if base_model else ""),
        "## Architecture\n\n" + _architecture_lines(config, task),
    ]
    if metrics:
        rows = "\n".join(f"| {name} | {_format(value)} |" for name, value in sorted(metrics.items()))
        sections.append("## Evaluation results\n\n" + (f"Data: {dataset}\n\n" if dataset else "")
                        + "| metric | value |\n|---|---|\n" + rows)
    if command:
        sections.append("## Training command\n\n```bash\n" + command + "\n```")
    sections.append(
        "## Usage\n\nThe modeling code ships with the checkpoint (`trust_remote_code=True`); with the `plat` "
        "package installed, `import modeling_plat` registers the classes instead.\n\n```python\n" + usage + "\n```"
    )
    return "\n\n".join(sections) + "\n"


def write_model_card(output_dir, config, task, model_id=None, **kwargs):
    """Write ``output_dir/README.md``; ``model_id`` defaults to the folder itself (usable as printed)."""
    output_dir = Path(output_dir)
    text = model_card_text(config, task, model_id or str(output_dir.resolve()), **kwargs)
    (output_dir / "README.md").write_text(text)
    return output_dir / "README.md"


def current_command():
    """The command line that started this process, shell-quoted."""
    return " ".join(shlex.quote(arg) for arg in ["python", *sys.argv])


class PlatModelCardMixin:
    """Trainer mixin: the README.md that ``save``/``push_to_hub`` produce is the p-LaT model card.

    Trainer calls ``create_model_card`` from ``push_to_hub`` (with the ``dataset``/``finetuned_from`` keywords
    the scripts pass); the card takes its metrics from ``all_results.json``. Models that are not p-LaT keep
    Trainer's own card.
    """

    def create_model_card(self, dataset=None, finetuned_from=None, **kwargs):
        model = self.accelerator.unwrap_model(self.model)
        if not isinstance(model.config, PlatConfig):
            return super().create_model_card(dataset=dataset, finetuned_from=finetuned_from, **kwargs)
        if not self.is_world_process_zero():
            return None
        results = Path(self.args.output_dir) / "all_results.json"
        metrics = json.loads(results.read_text()) if results.exists() else None
        # A local folder means nothing on the Hub: only hub ids become base_model.
        base_model = finetuned_from if finetuned_from and not Path(finetuned_from).exists() else None
        task = "text-generation" if isinstance(model, GenerationMixin) else "image-classification"
        model_id = self.hub_model_id if self.args.push_to_hub else None
        return write_model_card(self.args.output_dir, model.config, task, model_id=model_id, metrics=metrics,
                                dataset=dataset, command=current_command(), base_model=base_model)


class PlatTrainer(PlatModelCardMixin, Trainer):
    """Trainer whose saved and pushed model card is the p-LaT one."""
