"""p-Laplacian attention: the input checks and the choice of backend. The maths is in ``plap_attention_reference``.

Backends, each computing ``plap_attention_reference`` (tests compare every one with a float64 reference):
    eager   the reference itself: (B, H, Nq, Nk) memory, any input, the only one that differentiates p.
    decode  plap_attention_decode.py: a few new queries against a KV cache, in a handful of kernels.
    tiled   plap_attention_tiled.py: PyTorch tiles with an online softmax, O(N) extra memory.
    triton  plap_attention_triton.py: fused kernels for CUDA (or CPU under TRITON_INTERPRET=1).
Each backend states why it cannot run an input (``unsupported_reason``); "auto" takes the first backend of a
preference list (``preference``) that has no objection, once per group of heads. Heads with p = 2 are softmax
attention in every formulation and run through ``scaled_dot_product_attention`` whatever the backend.
Nothing here reads a tensor on the host: p is static data, so compiled graphs do not break and GPUs do not wait.
"""

import math
import os

import torch
import torch.nn.functional as F

from .plap_attention_decode import DECODE_MAX_QUERIES, decode_unsupported_reason, plap_attention_decode
from .plap_attention_tiled import plap_attention_tiled
from .plap_attention_reference import FORMULATIONS, allowed_positions, plap_attention_eager

# On CPU the eager backend beats the tiled one up to this many scores (B * H * Nq * Nk of the heads with p != 2)
# per intra-op thread: its few large kernels cost less than the tiled loop's per-call overhead. Re-derive with
# `python benchmarks/bench_attention.py` (crossovers per machine in docs/performance.md).
EAGER_MAX_SCORES_PER_THREAD_CPU = 65536


class Backend:
    """A backend's entry point and what it can run: ``run(q, k, v, *, p, attn_mask, is_causal, document_ids, eps,
    formulation)`` returns the (B, H, Nq, dv) output; ``limits``, when given, states the input limits of its own."""

    def __init__(self, name, run, formulations, differentiates_p=False, limits=None):
        self.name, self.run, self.formulations = name, run, formulations
        self.differentiates_p, self.limits = differentiates_p, limits

    def unsupported_reason(self, query, key, value, *, p, p_trains, attn_mask, document_ids, formulation):
        """Why this backend cannot run the input, or None."""
        if p_trains and not self.differentiates_p:
            return f"backend {self.name!r} computes no gradient for p, which requires grad; use 'eager'"
        if formulation not in self.formulations:
            return f"backend {self.name!r} does not implement formulation {formulation!r}; use 'eager'"
        if self.limits is not None:
            return self.limits(query, key, value, p=p, attn_mask=attn_mask, document_ids=document_ids,
                               formulation=formulation)
        return None


def _eager(query, key, value, **kwargs):
    return plap_attention_eager(query, key, value, **kwargs)[0]


# The Triton module imports triton (seconds) and, under TRITON_INTERPRET=1, the interpreter: loaded on first use.
def _triton(query, key, value, **kwargs):
    from .plap_attention_triton import plap_attention_triton

    return plap_attention_triton(query, key, value, **kwargs)


def _triton_limits(query, key, value, **kwargs):
    if query.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton kernels need CUDA tensors (CPU tensors run only under TRITON_INTERPRET=1)"
    from .plap_attention_triton import triton_unsupported_reason

    return triton_unsupported_reason(query, key, value, **kwargs)


REGISTRY = {
    "eager": Backend("eager", _eager, tuple(FORMULATIONS), differentiates_p=True),
    "decode": Backend("decode", plap_attention_decode, ("paper", "euler"), limits=decode_unsupported_reason),
    "tiled": Backend("tiled", plap_attention_tiled, ("paper", "euler")),
    "triton": Backend("triton", _triton, ("paper", "euler"), limits=_triton_limits),
}
BACKENDS = ("auto", *REGISTRY)


@torch.compiler.assume_constant_result
def _intra_op_threads():
    return torch.get_num_threads()


def preference(query, key):
    """Backends "auto" tries, fastest first (measured: `python benchmarks/bench_attention.py`).

    A few queries (decoding with a KV cache): the decode path. CUDA: the fused kernels. CPU: eager for small
    inputs, tiled (O(N) memory) above. While ``torch.export`` traces, the eager reference: plain tensor
    operations with no size-dependent Python loop.
    """
    if torch.compiler.is_exporting():
        return ("eager",)
    if query.shape[-2] <= DECODE_MAX_QUERIES:
        return ("decode", "eager")
    if query.device.type == "cuda":
        return ("triton", "tiled", "eager")
    scores = query.shape[:-1].numel() * key.shape[-2]
    if query.device.type == "cpu" and scores <= EAGER_MAX_SCORES_PER_THREAD_CPU * _intra_op_threads():
        return ("eager", "tiled")
    return ("tiled", "eager")


def choose_backend(backend, query, key, value, *, p, p_trains=False, attn_mask=None, document_ids=None,
                   formulation="paper"):
    """The backend that runs these heads: ``backend`` itself when it can (else a ValueError saying why), or for
    "auto" the first of ``preference`` with no objection."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    candidates = preference(query, key) if backend == "auto" else (backend,)
    reasons = []
    for name in candidates:
        reason = REGISTRY[name].unsupported_reason(
            query, key, value, p=p, p_trains=p_trains, attn_mask=attn_mask, document_ids=document_ids,
            formulation=formulation,
        )  # fmt: skip
        if reason is None:
            return REGISTRY[name]
        reasons.append(reason)
    if backend != "auto":
        raise ValueError(f"backend {backend!r} cannot run this input: {reasons[0]}")
    return REGISTRY["eager"]


def _check_inputs(query, key, value, num_p, attn_mask, document_ids, eps, formulation):
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query, key and value must be 4-D (B, H, N, d); got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[:2] != key.shape[:2] or key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} must share "
            "(B, H), and key and value their length"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key head sizes differ: {query.shape[-1]} vs {key.shape[-1]}")
    batch, num_heads, num_queries = query.shape[:3]
    num_keys = key.shape[-2]
    if num_queries > num_keys:
        raise ValueError(
            f"p-Laplacian attention needs each query's own value: {num_queries} queries cannot be more "
            f"than {num_keys} keys"
        )
    if num_p != num_heads:
        raise ValueError(f"p must have one value per head ({num_heads}); got {num_p}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {tuple(FORMULATIONS)}; got {formulation!r}")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(f"attn_mask must be boolean (True = may attend); got {attn_mask.dtype}")
        target = (batch, num_heads, num_queries, num_keys)
        try:
            torch.broadcast_shapes(attn_mask.shape, target)
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Nq, Nk) = {target}"
            ) from None
    if document_ids is not None:
        if document_ids.shape != (batch, num_keys) or num_queries != num_keys:
            raise ValueError(
                f"document_ids must be (B, N) = {(batch, num_keys)} with as many queries as keys (packed "
                f"sequences cannot use a KV cache); got {tuple(document_ids.shape)} for {num_queries} queries"
            )
        if document_ids.is_floating_point() or document_ids.dtype == torch.bool:
            raise ValueError(f"document_ids must be integers; got {document_ids.dtype}")


def _static_p(p, num_heads):
    """(values, tensor): p per head as a tuple of floats, and p itself when it is a tensor that requires grad.

    A tensor is read on the host (a GPU synchronises): models pass tuples, known when they are built.
    """
    if isinstance(p, torch.Tensor):
        trains = p.requires_grad and torch.is_grad_enabled()
        if trains and (p.device.type != "cpu" or torch.compiler.is_compiling()):
            return None, p
        values = p.tolist()
        values = [values] * num_heads if p.dim() == 0 else values
        return tuple(float(v) for v in values), p if trains else None
    if isinstance(p, (int, float)):
        return (float(p),) * num_heads, None
    return tuple(float(v) for v in p), None


def head_groups(p_values, num_heads):
    """Runs of consecutive heads as (first, end, softmax), softmax True for a run of p = 2 heads.

    One run of every head when p's values are not known on the host (a p that trains on a GPU).
    """
    if p_values is None:
        return [(0, num_heads, False)]
    groups = []
    for head, value in enumerate(p_values):
        softmax = value == 2
        if groups and groups[-1][2] == softmax:
            groups[-1] = (groups[-1][0], head + 1, softmax)
        else:
            groups.append((head, head + 1, softmax))
    return groups


def _heads(tensor, first, end, num_heads):
    """Heads [first, end) of a (B|1, H|1, ...) tensor (a mask broadcast over heads stays whole)."""
    if tensor is None or (first, end) == (0, num_heads):
        return tensor
    four_d = tensor.view((1,) * (4 - tensor.dim()) + tuple(tensor.shape))  # (B|1, H|1, Nq|1, Nk|1)
    return four_d if four_d.shape[1] == 1 else four_d[:, first:end]


def softmax_attention(query, key, value, *, attn_mask=None, is_causal=False, document_ids=None):
    """Softmax attention (p = 2) through ``scaled_dot_product_attention``, with this module's conventions.

    Causal masking bottom-right aligned (SDPA's own is top-left when Nq < Nk); rows with no allowed key
    output zeros with zero gradients (some SDPA kernels give NaN there); the output in ``query``'s dtype.
    """
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    sdpa_causal = is_causal and attn_mask is None and document_ids is None and num_queries == num_keys
    allowed = None
    if not sdpa_causal:
        allowed = allowed_positions(
            attn_mask, is_causal and num_queries > 1, num_queries, num_keys, query.device, document_ids
        )
    with torch.autocast(query.device.type, enabled=False):
        key, value = key.to(query.dtype), value.to(query.dtype)
        if allowed is None:
            # A literal: under torch.compile and torch.export the lengths are symbols, and SDPA takes a plain bool.
            return F.scaled_dot_product_attention(query, key, value, is_causal=True if sdpa_causal else False)
        has_key = allowed.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed | ~has_key)
        return torch.where(has_key, out, 0)


def plap_attention(
    query, key, value, p, *, attn_mask=None, is_causal=False, document_ids=None, eps=1e-6, formulation="paper",
    backend="auto",
):  # fmt: skip
    """p-Laplacian attention of (B, H, N, d) inputs with one exponent per head.

    Args:
        query: (B, H, Nq, d). key: (B, H, Nk, d). value: (B, H, Nk, dv), Nq <= Nk; the queries are the
            last Nq tokens (their own values are the last Nq values), as with a KV cache.
        p: one exponent per head, p >= 1: a sequence of floats (static: what models pass), a float for all
            heads, or an (H,) tensor (read on the host, unless it requires grad: then the eager backend
            differentiates it).
        attn_mask: optional boolean mask broadcastable to (B, H, Nq, Nk), True = may attend
            (the ``scaled_dot_product_attention`` convention).
        is_causal: causal mask, bottom-right aligned when Nq < Nk.
        document_ids: optional (B, N) integers of packed rows (Nq == Nk): a token attends only within its
            document, so that each document gets what it gets alone.
        eps: added to the squared distances before the power.
        formulation: a key of ``FORMULATIONS`` ("paper": eq. 12, "euler": exact Euler step of eq. 7, ...).
        backend: "auto" or one of ``REGISTRY`` (see the module docstring).

    Returns:
        (B, H, Nq, dv) tensor in the dtype of ``query``; rows with every key masked are zero.
    """
    num_heads = query.shape[1] if query.dim() == 4 else 0
    p_values, p_tensor = _static_p(p, num_heads)
    num_p = len(p_values) if p_values is not None else p_tensor.numel()
    _check_inputs(query, key, value, num_p, attn_mask, document_ids, eps, formulation)
    if p_values is not None and not all(math.isfinite(v) and v >= 1 for v in p_values):
        raise ValueError(f"p must be finite and >= 1; got {list(p_values)}")
    outputs = []
    for first, end, softmax in head_groups(None if p_tensor is not None else p_values, num_heads):
        q, k, v = (_heads(t, first, end, num_heads) for t in (query, key, value))
        mask = _heads(attn_mask, first, end, num_heads)
        if softmax:
            outputs.append(softmax_attention(q, k, v, attn_mask=mask, is_causal=is_causal, document_ids=document_ids))
            continue
        group_p = p_tensor if p_tensor is not None else p_values[first:end]
        chosen = choose_backend(
            backend, q, k, v, p=group_p, p_trains=p_tensor is not None, attn_mask=mask, document_ids=document_ids,
            formulation=formulation,
        )  # fmt: skip
        outputs.append(
            chosen.run(q, k, v, p=group_p, attn_mask=mask, is_causal=is_causal, document_ids=document_ids, eps=eps,
                       formulation=formulation)
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, 1)  # (B, H, Nq, dv)
