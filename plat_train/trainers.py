"""The Trainer subclasses of the jobs: the p-LaT model card on save and push (``PlatModelCardMixin``), the
language-model trainer, and the DeiT-style image trainer (soft-target loss with Mixup/CutMix and label
smoothing, DeiT's weight-decay exclusions)."""

import json
import random
from pathlib import Path

from torch.nn import functional as F
from transformers import GenerationMixin, Trainer
from transformers.modelcard import extract_hyperparameters_from_trainer

from modeling_plat import PlatConfigBase
from modeling_plat.attention_interface import ATTN_IMPLEMENTATION

from .model_cards import current_command, plap_interface_section, write_model_card
from .preemption import CheckpointOnSigtermMixin
from .text_metrics import perplexity

# Parameters without weight decay besides biases and norms (which Trainer already spares): DeiT's
# ``no_weight_decay`` set, learned tokens and positions.
NO_DECAY_NAME_PARTS = ("cls_token", "position_embeddings")


class PlatModelCardMixin:
    """Trainer mixin: the README.md that ``save``/``push_to_hub`` produce is the p-LaT model card.

    Trainer calls ``create_model_card`` from ``push_to_hub`` (with the ``dataset``/``finetuned_from`` keywords
    the jobs pass); the card takes its metrics from ``all_results.json`` and its hyperparameters from the
    Trainer's arguments. Other models keep Trainer's own card, with how to load them where they run p-LaT through
    attn_implementation="plap".
    """

    def create_model_card(self, dataset=None, finetuned_from=None, license=None, **kwargs):
        model = self.accelerator.unwrap_model(self.model)
        task = "text-generation" if isinstance(model, GenerationMixin) else "image-classification"
        if not isinstance(model.config, PlatConfigBase):
            super().create_model_card(dataset=dataset, finetuned_from=finetuned_from, license=license, **kwargs)
            card = Path(self.args.output_dir) / "README.md"
            if model.config._attn_implementation == ATTN_IMPLEMENTATION and self.is_world_process_zero():
                model_id = self.hub_model_id if self.args.push_to_hub else str(Path(self.args.output_dir).resolve())
                card.write_text(card.read_text() + "\n" + plap_interface_section(model.config, model_id, task))
            return None
        if not self.is_world_process_zero():
            return None
        results = Path(self.args.output_dir) / "all_results.json"
        metrics = json.loads(results.read_text()) if results.exists() else None
        # A local folder means nothing on the Hub: only hub ids become base_model.
        base_model = finetuned_from if finetuned_from and not Path(finetuned_from).exists() else None
        model_id = self.hub_model_id if self.args.push_to_hub else None
        extra = {"license": license} if license else {}
        return write_model_card(self.args.output_dir, model.config, task, model_id=model_id, metrics=metrics,
                                dataset=dataset, command=current_command(), base_model=base_model,
                                hyperparameters=extract_hyperparameters_from_trainer(self), **extra)


class PlatTrainer(PlatModelCardMixin, CheckpointOnSigtermMixin, Trainer):
    """The language-model trainer: its saved and pushed model card is the p-LaT one; ``--enable_jit_checkpoint`` stops
    training at a checkpoint on SIGTERM (``preemption``); every evaluation reports the perplexity beside the loss, so
    that the trackers and ``--metric_for_best_model perplexity`` see it while training; ``train_data_collator``, when
    given, batches the training set alone (padding-free packed documents), evaluation keeping ``data_collator``'s
    blocks."""

    def __init__(self, *args, train_data_collator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_data_collator = train_data_collator

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):  # fmt: skip
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        loss = output.metrics.get(f"{metric_key_prefix}_loss")
        if loss is not None:  # before evaluate logs the metrics and the best checkpoint is chosen by them
            output.metrics[f"{metric_key_prefix}_perplexity"] = perplexity(loss)
        return output

    def get_train_dataloader(self):
        if self.train_data_collator is None:
            return super().get_train_dataloader()
        eval_collator, self.data_collator = self.data_collator, self.train_data_collator
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = eval_collator


class ImageClassificationTrainer(PlatModelCardMixin, CheckpointOnSigtermMixin, Trainer):
    """Trainer whose training loss is cross-entropy against soft targets.

    The model's own loss reads float labels as multi-label BCE; here, while training, Mixup/CutMix (when
    given) turns class indices into mixed one-hot targets and ``label_smoothing_factor`` smooths them, so
    ``F.cross_entropy`` with probability targets is the right loss. Evaluation uses the hard labels and
    plain cross-entropy, so eval loss and accuracy are comparable across recipes. Its model card is the
    p-LaT one (``PlatModelCardMixin``); ``--enable_jit_checkpoint`` stops training at a checkpoint on SIGTERM
    (``preemption``).
    """

    # The loss is a per-batch mean: let Trainer divide it over gradient accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, mixup=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.mixup = mixup
        # Offset by rank so that processes mix differently; seeded so a run repeats.
        self.mixup_rng = random.Random(self.args.seed + self.args.process_index)
        self.model_accepts_loss_kwargs = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        pixel_values = inputs["pixel_values"]
        smoothing = 0.0
        if model.training:
            smoothing = self.args.label_smoothing_factor
            if self.mixup is not None:
                pixel_values, labels = self.mixup(pixel_values, labels, self.mixup_rng)
        outputs = model(pixel_values=pixel_values)
        loss = F.cross_entropy(outputs.logits.float(), labels, label_smoothing=smoothing)
        return (loss, outputs) if return_outputs else loss

    def get_decay_parameter_names(self, model):
        return [
            name for name in super().get_decay_parameter_names(model)
            if not any(part in name for part in NO_DECAY_NAME_PARTS)
        ]
