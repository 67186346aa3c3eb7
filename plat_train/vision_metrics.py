"""Image-classification metrics for Trainer: top-1 / top-5 accuracy from each row's best classes."""

import numpy as np

TOP_K = 5


def top_k_indices(logits, labels):
    """Keep only each row's TOP_K best classes, (B, k): evaluation then never holds (N, num_labels) logits."""
    return logits.topk(min(TOP_K, logits.shape[-1]), dim=-1).indices


def accuracy_metrics(eval_prediction):
    top_k, labels = eval_prediction.predictions, eval_prediction.label_ids
    hits = np.asarray(top_k) == np.asarray(labels)[:, None]  # (N, k)
    return {"top1_accuracy": float(hits[:, 0].mean()), f"top{TOP_K}_accuracy": float(hits.any(axis=1).mean())}
