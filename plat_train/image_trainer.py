"""Trainer pieces for DeiT-style image classification: soft-target loss with Mixup/CutMix and label smoothing,
DeiT's weight-decay exclusions, top-1/top-5 metrics."""

import random

import numpy as np
import torch
from torch.nn import functional as F
from transformers import Trainer

from plat_train.model_card import PlatModelCardMixin

# Parameters without weight decay besides biases and norms (which Trainer already spares): DeiT's
# ``no_weight_decay`` set, learned tokens and positions.
NO_DECAY_NAME_PARTS = ("cls_token", "position_embeddings")
TOP_K = 5


class ImageClassificationTrainer(PlatModelCardMixin, Trainer):
    """Trainer whose training loss is cross-entropy against soft targets.

    The model's own loss reads float labels as multi-label BCE; here, while training, Mixup/CutMix (when
    given) turns class indices into mixed one-hot targets and ``label_smoothing_factor`` smooths them, so
    ``F.cross_entropy`` with probability targets is the right loss. Evaluation uses the hard labels and
    plain cross-entropy, so eval loss and accuracy are comparable across recipes. Its model card is the
    p-LaT one (``PlatModelCardMixin``).
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


def top_k_indices(logits, labels):
    """Keep only each row's TOP_K best classes, (B, k): evaluation then never holds (N, num_labels) logits."""
    return logits.topk(min(TOP_K, logits.shape[-1]), dim=-1).indices


def accuracy_metrics(eval_prediction):
    top_k, labels = eval_prediction.predictions, eval_prediction.label_ids
    hits = np.asarray(top_k) == np.asarray(labels)[:, None]  # (N, k)
    return {"top1_accuracy": float(hits[:, 0].mean()), f"top{TOP_K}_accuracy": float(hits.any(axis=1).mean())}
