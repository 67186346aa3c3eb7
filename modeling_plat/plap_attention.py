"""p-Laplacian attention (p-LaT, arXiv 2311.03235, eq. 12): the readable reference and the backend dispatcher.

For one head with exponent p, queries/keys/values q, k, v of shape (B, H, N, d):

    A       = softmax(q k^T / sqrt(d) + mask)                  row-normalised attention
    D2[x,y] = ||v_x - v_y||^2                                  squared value distances
    P[x,y]  = (D2[x,y] + eps) ** ((p - 2) / 2)                 the p-Laplacian weight
    paper:  U = (A * P) V                                      eq. 12, rows of A * P need not sum to 1
    euler:  U = v_x + sum_{y != x} W[x,y] (v_y - v_x),  W = A * P
            the exact explicit Euler step of the gradient flow (eq. 7) that eq. 12 simplifies;
            the y = x term vanishes, so there is no eps ** ((p - 2) / 2) self-weight.

With p = 2 both formulations are plain softmax attention. P is always computed in float32 or wider:
eps = 1e-6 is below fp16 resolution and the (p - 4) / 2 powers of the backward overflow half types.
"""

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from .float32_matmul import float32_baddbmm

FORMULATIONS = ("paper", "euler")
BACKENDS = ("auto", "eager", "tiled", "triton")
# Per intra-op thread, up to this many scores in all (B * H * Nq * Nk, the heads with p != 2) the eager path
# beats the tiled one on CPU: its few large kernels cost less than the tiled loop's fixed per-call overhead.
# Measured fwd+bwd, float32, p = 1.5 / 2.5, B = 1 / 4 / 16, H = 4, N = 8 ... 256, d = 16 and 64, causal or
# not (AMD EPYC, torch 2.13): with 1 thread eager and tiled tie between 16k and 64k scores at d = 16 and
# between 64k and 256k at d = 64; with 2 threads the ties move to 64k-256k and ~256k.
EAGER_MAX_SCORES_PER_THREAD_CPU = 65536


def _allowed_positions(attn_mask, is_causal, num_queries, num_keys, device):
    """Boolean (..., Nq, Nk) mask of the pairs that may attend, or None when all may.

    Causal masking is bottom-right aligned: query i is the token at key position Nk - Nq + i.
    """
    allowed = None
    if is_causal:
        query_pos = torch.arange(num_queries, device=device) + (num_keys - num_queries)
        allowed = torch.arange(num_keys, device=device)[None, :] <= query_pos[:, None]  # (Nq, Nk)
    if attn_mask is not None:
        allowed = attn_mask if allowed is None else allowed & attn_mask
    return allowed


def _self_pairs(num_queries, num_keys, device):
    """(Nq, Nk) boolean mask of the pairs (x, x): query i against its own key position Nk - Nq + i."""
    query_pos = torch.arange(num_queries, device=device) + (num_keys - num_queries)
    return torch.arange(num_keys, device=device)[None, :] == query_pos[:, None]


def squared_value_distances(value, num_queries):
    """D2[x, y] = ||v_x - v_y||^2 for the last ``num_queries`` values x against all values y.

    Uses |v_x|^2 + |v_y|^2 - 2 v_x.v_y (one matmul, like torch.cdist, float32-exact: see
    ``float32_baddbmm``), clamped at 0 against rounding, and sets the self pairs to an exact 0 with no gradient.
    """
    num_keys = value.shape[-2]
    flat = value.flatten(0, -3)  # (B * H, Nk, dv)
    v_query = flat[:, num_keys - num_queries :]  # (BH, Nq, dv)
    sq_norm = flat.pow(2).sum(-1)  # (BH, Nk)
    d2 = float32_baddbmm(sq_norm[:, None, :], v_query, flat.transpose(1, 2), alpha=-2)  # |v_y|^2 - 2 v_x.v_y
    d2 = (d2 + sq_norm[:, num_keys - num_queries :, None]).clamp_min(0).unflatten(0, value.shape[:-2])
    return torch.where(_self_pairs(num_queries, num_keys, value.device), 0.0, d2)  # (B, H, Nq, Nk)


def plap_attention_weights(query, key, value, p, attn_mask=None, is_causal=False, eps=1e-6, formulation="paper"):
    """The effective attention matrix M with U = M V, in float32 (float64 for float64 inputs).

    paper: M = A * P.  euler: M = W_off + diag(1 - rowsum(W_off)) with W_off = A * P off the self pairs.
    Rows whose every key is masked are zero. Inputs are assumed checked (see ``plap_attention``).
    """
    with torch.autocast(query.device.type, enabled=False):  # autocast would run the matmuls in half precision
        return _weights_float32(query, key, value, p, attn_mask, is_causal, eps, formulation)


def _weights_float32(query, key, value, p, attn_mask, is_causal, eps, formulation):
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(compute_dtype), key.to(compute_dtype), value.to(compute_dtype)
    allowed = _allowed_positions(attn_mask, is_causal, num_queries, num_keys, query.device)

    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, Nq, Nk)
    if allowed is not None:
        # A finite fill (not -inf) keeps fully masked rows free of NaN in forward and backward.
        scores = scores.masked_fill(~allowed, torch.finfo(compute_dtype).min)
    attn = torch.softmax(scores, dim=-1)

    half_p_minus_2 = ((p.to(compute_dtype) - 2) / 2).view(1, -1, 1, 1)  # (1, H, 1, 1)
    d2 = squared_value_distances(v, num_queries)
    if allowed is not None:
        d2 = torch.where(allowed, d2, 1.0)  # excluded before the power: no inf * 0 anywhere
    plap = (d2 + eps).pow(half_p_minus_2)  # (B, H, Nq, Nk)
    weights = attn * plap

    if formulation == "euler":
        self_pairs = _self_pairs(num_queries, num_keys, query.device)
        weights = torch.where(self_pairs, 0.0, weights)
        weights = weights + torch.where(self_pairs, 1 - weights.sum(-1, keepdim=True), 0.0)
    if allowed is not None:
        weights = torch.where(allowed.any(-1, keepdim=True), weights, 0.0)
    return weights


def _eager(query, key, value, p, attn_mask, is_causal, eps, formulation):
    weights = plap_attention_weights(query, key, value, p, attn_mask, is_causal, eps, formulation)
    with torch.autocast(query.device.type, enabled=False):
        return (weights @ value.to(weights.dtype)).to(query.dtype)


def _check_inputs(query, key, value, p, attn_mask, eps, formulation):
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
    if query.shape[-2] > key.shape[-2]:
        raise ValueError(
            f"p-Laplacian attention needs each query's own value: {query.shape[-2]} queries cannot be more "
            f"than {key.shape[-2]} keys"
        )
    num_heads = query.shape[1]
    if p.shape != (num_heads,):
        raise ValueError(f"p must have one value per head, shape ({num_heads},); got {tuple(p.shape)}")
    # Reading p's values synchronises a GPU and breaks compiled graphs; models validate p in their config.
    values_readable = p.device.type == "cpu" and not torch.compiler.is_compiling()
    if values_readable and (not bool(torch.isfinite(p).all()) or bool((p < 1).any())):
        raise ValueError(f"p must be finite and >= 1; got {p.tolist()}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}; got {formulation!r}")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(f"attn_mask must be boolean (True = may attend); got {attn_mask.dtype}")
        target = (query.shape[0], num_heads, query.shape[-2], key.shape[-2])
        try:
            torch.broadcast_shapes(attn_mask.shape, target)
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Nq, Nk) = {target}"
            ) from None


def resolve_backend(backend, query, key=None, attn_mask=None, p=None, value=None, max_p=None):
    """The backend that ``backend`` names for this input's heads with p != 2; "auto" picks the fastest correct one.

    eager: the reference above, (B, H, Nq, Nk) memory, any input, the only one that differentiates p.
    tiled: plap_attention_tiled.py, O(N) extra memory, any input except a p that requires grad.
    triton: plap_attention_triton.py, fused kernels for CUDA (or CPU under TRITON_INTERPRET=1),
        float32/bfloat16/float16, masks broadcastable to (B, 1, 1, Nk) (key padding) only; its static limits
        (Triton version, compute capability, head sizes, ...) are in ``triton_unsupported_reason``.
    Heads with p = 2 are softmax attention exactly and ``plap_attention`` runs them through SDPA whatever the
    backend, unless p requires grad (see ``head_groups``).

    "auto", by measured crossovers: eager when p requires grad; on CUDA triton wherever
    ``triton_unsupported_reason`` finds no limit it breaks, else tiled; on CPU eager up to
    EAGER_MAX_SCORES_PER_THREAD_CPU scores (B * H * Nq * Nk, counting the heads with p != 2 only) per intra-op
    thread, tiled above (O(N) memory); tiled otherwise. Heads with p = 2 take
    SDPA on every device and size: one fused kernel, faster than either.
    An explicit choice that cannot run the input raises a ValueError saying why; it is never replaced.
    ``key`` and ``value`` default to ``query``'s shape and dtype. ``max_p``, the largest of these heads' p, is
    read from ``p`` when not given (``plap_attention`` gives it: a slice of p would be read anew every call).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    p_trains = p is not None and p.requires_grad and torch.is_grad_enabled()
    if max_p is None and p is not None:
        max_p = _largest(host_values(p))
    if backend == "auto":
        if p_trains:
            return "eager"
        if query.device.type == "cuda":
            from .plap_attention_triton import triton_unsupported_reason

            if triton_unsupported_reason(query, key, value, p=(max_p,) if max_p else (), attn_mask=attn_mask) is None:
                return "triton"
        num_keys = query.shape[-2] if key is None else key.shape[-2]
        scores = query.shape[:-1].numel() * num_keys
        small = query.device.type == "cpu" and scores <= EAGER_MAX_SCORES_PER_THREAD_CPU * torch.get_num_threads()
        return "eager" if small else "tiled"
    if backend != "eager" and p_trains:
        raise ValueError(f"backend {backend!r} computes no gradient for p, which requires grad; use 'eager'")
    if backend == "triton":
        from .plap_attention_triton import triton_unsupported_reason

        reason = triton_unsupported_reason(query, key, value, p=(max_p,) if max_p else (), attn_mask=attn_mask)
        if reason is not None:
            raise ValueError(f"backend 'triton' cannot run this input: {reason}")
    return backend


# Host copies of p per tensor object and in-place version: a GPU synchronises once per p tensor, not per call.
_HOST_P = WeakIdKeyDictionary()


def _largest(values):
    return max(values) if values else None


def host_values(p):
    """p's values as a Python list (read from a GPU once per tensor and in-place version), or None while
    torch.compile traces, where reading them would break the graph."""
    if torch.compiler.is_compiling():
        return None
    if p.device.type == "cpu":
        return p.tolist()
    version, values = _HOST_P.get(p, (None, None))
    if version != p._version:
        values = p.tolist()
        _HOST_P[p] = (p._version, values)
    return values


def head_groups(p):
    """Runs of consecutive heads as (first, end, softmax), softmax True for a run of p = 2 heads.

    One run of every head when p's values cannot be read without breaking a compiled graph, or when p
    requires grad (SDPA has no gradient for p).
    """
    num_heads = p.shape[0]
    values = host_values(p)
    if values is None or (p.requires_grad and torch.is_grad_enabled()):
        return [(0, num_heads, False)]
    groups = []
    for head, value in enumerate(values):
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


def softmax_attention(query, key, value, attn_mask=None, is_causal=False):
    """Softmax attention (p = 2) through ``scaled_dot_product_attention``, with this module's conventions.

    Causal masking bottom-right aligned (SDPA's own is top-left when Nq < Nk); rows with no allowed key
    output zeros with zero gradients (some SDPA kernels give NaN there); the output in ``query``'s dtype.
    """
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    sdpa_causal = is_causal and attn_mask is None and num_queries == num_keys
    allowed = None
    if not sdpa_causal:
        allowed = _allowed_positions(attn_mask, is_causal and num_queries > 1, num_queries, num_keys, query.device)
    with torch.autocast(query.device.type, enabled=False):
        key, value = key.to(query.dtype), value.to(query.dtype)
        if allowed is None:
            return F.scaled_dot_product_attention(query, key, value, is_causal=sdpa_causal)
        has_key = allowed.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed | ~has_key)
        return torch.where(has_key, out, 0)


def _run_backend(backend, query, key, value, p, attn_mask, is_causal, eps, formulation):
    if backend == "tiled":
        from .plap_attention_tiled import plap_attention_tiled

        return plap_attention_tiled(query, key, value, p, attn_mask, is_causal, eps, formulation)
    if backend == "triton":
        from .plap_attention_triton import plap_attention_triton

        return plap_attention_triton(query, key, value, p=tuple(host_values(p)), attn_mask=attn_mask,
                                     is_causal=is_causal, eps=eps, formulation=formulation)  # fmt: skip
    return _eager(query, key, value, p, attn_mask, is_causal, eps, formulation)


def plap_attention(
    query, key, value, p, attn_mask=None, is_causal=False, eps=1e-6, formulation="paper", backend="auto"
):
    """p-Laplacian attention of (B, H, N, d) inputs with one exponent per head.

    Args:
        query: (B, H, Nq, d). key: (B, H, Nk, d). value: (B, H, Nk, dv), Nq <= Nk; the queries are the
            last Nq tokens (their own values are the last Nq values), as with a KV cache.
        p: (H,) tensor (or a float / list), p >= 1.
        attn_mask: optional boolean mask broadcastable to (B, H, Nq, Nk), True = may attend
            (the ``scaled_dot_product_attention`` convention).
        is_causal: causal mask, bottom-right aligned when Nq < Nk.
        eps: added to the squared distances before the power.
        formulation: "paper" (eq. 12) or "euler" (exact Euler step of eq. 7).
        backend: "auto" or one of ``BACKENDS`` (see ``resolve_backend``); each run of consecutive heads
            with p = 2 goes to ``softmax_attention`` instead (SDPA; exact for both formulations).

    Returns:
        (B, H, Nq, dv) tensor in the dtype of ``query``; rows with every key masked are zero.
    """
    p = torch.as_tensor(p, device=query.device)
    if p.dim() == 0:
        p = p.expand(query.shape[1])
    _check_inputs(query, key, value, p, attn_mask, eps, formulation)
    values = host_values(p)
    # An explicit backend that cannot run the input raises here.
    resolve_backend(backend, query, key, attn_mask, p, value, max_p=_largest(values))
    num_heads = query.shape[1]
    outputs = []
    for first, end, softmax in head_groups(p):
        q, k, v = (_heads(t, first, end, num_heads) for t in (query, key, value))
        mask = _heads(attn_mask, first, end, num_heads)
        if softmax:
            outputs.append(softmax_attention(q, k, v, mask, is_causal))
        else:
            group_p = p[first:end]
            group_max_p = _largest(values and values[first:end])
            group_backend = resolve_backend(backend, q, k, mask, group_p, v, max_p=group_max_p)
            outputs.append(_run_backend(group_backend, q, k, v, group_p, mask, is_causal, eps, formulation))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, 1)  # (B, H, Nq, dv)
