"""p-Laplacian attention of a few new queries against a KV cache: the decoding step, in a handful of kernels.

Same maths as ``plap_attention_reference`` for Nq <= DECODE_MAX_QUERIES queries (the last Nq tokens) against Nk
keys. With so few queries the squared distances are formed by direct differences, O(Nq Nk dv) like the
expansion and exact: no cancellation to guard against, the self pair is an exact 0 by itself, and no (Nq, Nk)
self-pair or causal mask is built for a single query (which sees every key). Coinciding pairs (the reference's
COINCIDING rule) are an exact 0 with no gradient, as in every backend.
"""

import torch

from .plap_attention_reference import COINCIDING, formulation_of, implemented

# Queries per call up to which the direct differences (B, H, Nq, Nk, dv) stay cheaper than the matmul expansion
# and the mask tensors of the reference: one decoded token, or a few of speculative decoding.
DECODE_MAX_QUERIES = 4

FORMULATIONS = implemented("paper", "euler")

_exponents = {}


def _exponent(p, dtype, device):
    """(1, H, 1, 1) tensor of (p - 2) / 2, built once per p, dtype and device: no host-to-device copy per step."""
    key = (p, dtype, device)
    if key not in _exponents:
        _exponents[key] = ((torch.tensor(p, dtype=dtype, device=device) - 2) / 2).view(1, -1, 1, 1)
    return _exponents[key]


def decode_unsupported_reason(query, key, value, *, p, attn_mask=None, document_ids=None, formulation="paper"):
    if query.shape[-2] > DECODE_MAX_QUERIES:
        return f"more than {DECODE_MAX_QUERIES} queries (the decode path is for a few new tokens)"
    if document_ids is not None:
        return "packed rows have no KV cache"
    return None


def plap_attention_decode(
    query, key, value, *, p, attn_mask=None, is_causal=False, document_ids=None, eps=1e-6, formulation="paper"
):
    """Arguments as ``plap_attention`` (checked there); (B, H, Nq, dv) in ``query``'s dtype."""
    euler = formulation_of(formulation, FORMULATIONS, "decode").self_pair == "euler"
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    with torch.autocast(query.device.type, enabled=False):
        q, k, v = query.to(compute_dtype), key.to(compute_dtype), value.to(compute_dtype)
        v_own = v[:, :, num_keys - num_queries :]  # (B, H, Nq, dv)
        scores = (q @ k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # (B, H, Nq, Nk)
        allowed = attn_mask
        if is_causal and num_queries > 1:
            query_pos = torch.arange(num_queries, device=q.device) + (num_keys - num_queries)
            causal = torch.arange(num_keys, device=q.device) <= query_pos[:, None]  # (Nq, Nk)
            allowed = causal if allowed is None else allowed & causal
        if allowed is not None:
            scores = scores.masked_fill(~allowed, torch.finfo(compute_dtype).min)
        attn = torch.softmax(scores, dim=-1)
        d2 = (v[:, :, None] - v_own[:, :, :, None]).square().sum(-1)  # (B, H, Nq, Nk), exact 0 on the self pair
        sq_norm = v.square().sum(-1)  # (B, H, Nk)
        coinciding = d2 <= COINCIDING * (sq_norm[:, :, None] + sq_norm[:, :, num_keys - num_queries :, None])
        d2 = torch.where(coinciding, 0.0, d2)
        weights = attn * (d2 + eps).pow(_exponent(tuple(p), compute_dtype, q.device))
        out = weights @ v  # (B, H, Nq, dv)
        if euler:
            # u_x = v_x + sum_{y != x} W (v_y - v_x): the self pair's term is zero, and its weight drops out.
            own = torch.diagonal(weights, offset=num_keys - num_queries, dim1=-2, dim2=-1)[..., None]  # (B, H, Nq, 1)
            out = out - own * v_own + (1 - (weights.sum(-1, keepdim=True) - own)) * v_own
        if allowed is not None:
            out = torch.where(allowed.any(-1, keepdim=True), out, 0.0)
        return out.to(query.dtype)
