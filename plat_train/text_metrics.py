"""Language-model metrics: token accuracy for Trainer.evaluate, and sliding-window perplexity.

Trainer.evaluate on packed blocks is the fast estimate: the first tokens of every block are scored with
little context. The sliding-window protocol of the p-LaT paper (and of Schlag et al. 2021) scores every
token with the longest context the model allows: windows of ``context_length`` tokens move by ``stride``
and score only the tokens that no earlier window scored. With stride 1 each window scores its last token,
except the first window, which scores all of its tokens.
"""

import contextlib
import math

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm


def perplexity(loss):
    """exp(loss), without overflowing for a diverged model."""
    return math.exp(loss) if loss < 700 else math.inf


def preprocess_logits_for_metrics(logits, labels):
    """Keep only the argmax of each position, so that evaluation does not gather (B, N, vocab) logits."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def token_accuracy(eval_prediction):
    """``compute_metrics`` for Trainer: the fraction of next tokens predicted exactly (labels -100 ignored)."""
    predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
    # The prediction at position i is for the token at i + 1.
    predictions, labels = predictions[:, :-1], labels[:, 1:]
    scored = labels != -100
    return {"accuracy": float((predictions[scored] == labels[scored]).mean())}


def window_plan(num_tokens, context_length, stride):
    """(begin, end, first_target) of every window: the window is stream[begin:end] and scores the
    tokens at positions first_target..end-1, each from the tokens before it inside the window.

    All windows have the same length, min(context_length, num_tokens): the last one is moved back to end
    at the stream's end. Token 0 has no context and is never scored; with stride == context_length the
    first token of every window is not scored either, exactly as in evaluation on packed blocks.
    """
    if num_tokens < 2:
        raise ValueError(f"Sliding-window evaluation needs at least 2 tokens; got {num_tokens}")
    length = min(context_length, num_tokens)
    if not 1 <= stride <= length:
        raise ValueError(f"eval_stride must be between 1 and the context length {length}; got {stride}")
    plan, scored_until, end = [], 0, length
    while scored_until < num_tokens:
        begin = end - length
        first_target = max(scored_until, begin + 1)
        plan.append((begin, end, first_target))
        scored_until, end = end, min(end + stride, num_tokens)
    return plan


@torch.no_grad()
def _score_windows(model, stream, windows, device, autocast):
    """Summed negative log-likelihood, correct argmax predictions and token count over a batch of windows."""
    inputs = torch.stack([stream[begin:end] for begin, end, _ in windows]).to(device)  # (B, L)
    num_targets = torch.tensor([end - first for _, end, first in windows], device=device)  # (B,)
    most = int(num_targets.max())
    with autocast():
        # Logits of the last `most + 1` positions; the very last predicts a token outside the window.
        logits = model(input_ids=inputs, logits_to_keep=most + 1, use_cache=False).logits[:, :-1]  # (B, most, V)
    targets = inputs[:, -most:]  # (B, most)
    nll = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # (B, most)
    scored = torch.arange(most, device=device)[None, :] >= (most - num_targets)[:, None]  # (B, most)
    correct = (logits.argmax(-1) == targets) & scored
    return torch.stack([(nll * scored).sum(), correct.sum().double(), scored.sum().double()]).double()


def sliding_window_metrics(model, stream, context_length, stride, batch_size=1, accelerator=None,
                           autocast=contextlib.nullcontext, desc="Sliding-window evaluation", disable_tqdm=False):
    """Perplexity, accuracy, loss and the number of scored tokens of ``model`` on a 1-D token ``stream``.

    Windows are batched ``batch_size`` at a time (the first window, which scores more tokens, alone) and,
    with an Accelerate ``accelerator`` over several processes, shared between them and summed.
    """
    device = next(model.parameters()).device
    plan = window_plan(len(stream), context_length, stride)
    batches = [plan[:1]] + [plan[i : i + batch_size] for i in range(1, len(plan), batch_size)]
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for windows in tqdm(batches[rank::world], desc=desc, disable=disable_tqdm or rank != 0):
        totals += _score_windows(model, stream, windows, device, autocast)
    model.train(was_training)
    if world > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    nll, correct, count = totals.tolist()
    loss = nll / count
    return {"perplexity": perplexity(loss), "accuracy": correct / count, "loss": loss, "tokens": int(count)}
