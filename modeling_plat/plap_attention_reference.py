"""p-Laplacian attention (p-LaT, arXiv 2311.03235, eq. 12), the readable reference: every backend computes this.

For one head with exponent p, queries/keys/values q, k, v of shape (B, H, N, d):

    A       = softmax(q k^T / sqrt(d) + mask)                  row-normalised attention
    D2[x,y] = ||v_x - v_y||^2                                  squared value distances
    P[x,y]  = (D2[x,y] + eps) ** ((p - 2) / 2)                 the p-Laplacian weight
    paper:  U = (A * P) V                                      eq. 12, rows of A * P need not sum to 1
    euler:  U = v_x + sum_{y != x} W[x,y] (v_y - v_x),  W = A * P
            the exact explicit Euler step of the gradient flow (eq. 7) that eq. 12 simplifies;
            the y = x term vanishes, so there is no eps ** ((p - 2) / 2) self-weight.

Two more formulations split eq. 12 into its parts (a 2 x 2 factorial with softmax and paper):
    noself:      eq. 12 with P[x, x] = 1: the p-Laplacian weighting of the other tokens alone.
    selfweight:  P = 1 for the other tokens, P[x, x] = eps ** ((p - 2) / 2): eq. 12's self-weight alone.

With p = 2 every formulation is plain softmax attention. P is always computed in float32 or wider: eps = 1e-6 is
below fp16 resolution and the (p - 4) / 2 powers of the backward overflow half types.

Where values coincide (a repeated token's value in a first layer) D2 = 0 and P takes its largest value, eps ** c
with c = (p - 2) / 2. The expansion |v_x|^2 + |v_y|^2 - 2 v_x.v_y that every backend uses for speed rounds to about
u (|v_x|^2 + |v_y|^2), far above eps, so each backend computes D2 accurately where it is small against the norms
(the rule below, docs/numerics.md): this module by the expansion in float64, the others by direct differences of
the close pairs. Pairs whose accurate D2 is at most COINCIDING (|v_x|^2 + |v_y|^2) coincide: D2 = 0, no gradient.
"""

from typing import NamedTuple

import torch


# Pairs whose expanded D2 is at most CLOSE_PAIR (|v_x|^2 + |v_y|^2) have D2 recomputed by direct differences by the
# tiled, decode and Triton backends. Above it the expansion's rounding, at most (d + 2) u (|v_x|^2 + |v_y|^2), is at
# most (d + 2) u / CLOSE_PAIR of D2; random pairs of a head size above 4 practically never fall below it.
CLOSE_PAIR = 2.0**-8
# Pairs whose D2 is at most COINCIDING (|v_x|^2 + |v_y|^2) coincide: D2 = 0 and no gradient through D2, like the
# self pair. The gradient dropped, 2 dL/dD2 (v_x - v_y), is then below the float32 rounding of the matmuls that
# form the distance gradient, 2 dL/dD2 v_x - 2 dL/dD2 v_y (|v_x - v_y| <= 2^-21.5 (|v_x| + |v_y|)), and P changes
# by a relative |c| D2 / eps at most; float64's expansion errs by far less than the bound.
COINCIDING = 2.0**-44


class Formulation(NamedTuple):
    """How the weight P treats the other tokens and the token itself."""

    weights_others: bool  # P = (D2 + eps) ** c for y != x; False: P = 1 (softmax weights)
    self_pair: str  # "power": P[x, x] = eps ** c (eq. 12 literally); "one": P[x, x] = 1; "euler": Euler step


FORMULATIONS = {
    "paper": Formulation(weights_others=True, self_pair="power"),
    "euler": Formulation(weights_others=True, self_pair="euler"),
    "noself": Formulation(weights_others=True, self_pair="one"),
    "selfweight": Formulation(weights_others=False, self_pair="power"),
}


def implemented(*names):
    """A fast backend's declaration of the formulations it computes: these entries of ``FORMULATIONS``. A name that
    the reference does not define fails when the backend is imported."""
    unknown = [name for name in names if name not in FORMULATIONS]
    if unknown:
        raise ValueError(f"formulations {unknown} are not defined in the reference (FORMULATIONS: {tuple(FORMULATIONS)})")
    return {name: FORMULATIONS[name] for name in names}


def formulation_of(name, formulations, backend):
    """The ``Formulation`` that ``backend`` computes for ``name``, ``formulations`` being what it implements; a
    ValueError for a name it does not implement (its code would compute another formulation silently)."""
    if name not in formulations:
        raise ValueError(
            f"the {backend} backend implements the formulations {tuple(formulations)}, not {name!r}; the eager "
            f"backend computes every one of {tuple(FORMULATIONS)}"
        )
    return formulations[name]


def allowed_positions(attn_mask, is_causal, num_queries, num_keys, device, document_ids=None):
    """Boolean (..., Nq, Nk) mask of the pairs that may attend, or None when all may.

    Causal masking is bottom-right aligned: query i is the token at key position Nk - Nq + i.
    ``document_ids`` (B, N) keeps each token of a packed row inside its own document (Nq == Nk).
    """
    allowed = None
    if is_causal:
        query_pos = torch.arange(num_queries, device=device) + (num_keys - num_queries)
        allowed = torch.arange(num_keys, device=device)[None, :] <= query_pos[:, None]  # (Nq, Nk)
    if document_ids is not None:
        same_document = (document_ids[:, :, None] == document_ids[:, None, :])[:, None]  # (B, 1, N, N)
        allowed = same_document if allowed is None else allowed & same_document
    if attn_mask is not None:
        allowed = attn_mask if allowed is None else allowed & attn_mask
    return allowed


def sliding_window_positions(num_queries, num_keys, window, device):
    """(Nq, Nk) boolean mask of a causal sliding window: the query at key position x (bottom-right aligned) may attend
    to the keys in (x - window, x], as transformers defines the window."""
    query_pos = torch.arange(num_queries, device=device) + (num_keys - num_queries)
    key_pos = torch.arange(num_keys, device=device)[None, :]
    return (key_pos <= query_pos[:, None]) & (key_pos > query_pos[:, None] - window)


def self_pairs(num_queries, num_keys, device):
    """(Nq, Nk) boolean mask of the pairs (x, x): query i against its own key position Nk - Nq + i."""
    query_pos = torch.arange(num_queries, device=device) + (num_keys - num_queries)
    return torch.arange(num_keys, device=device)[None, :] == query_pos[:, None]


def squared_value_distances(value, num_queries):
    """D2[x, y] = ||v_x - v_y||^2 for the last ``num_queries`` values x against all values y, in ``value``'s dtype.

    The expansion |v_x|^2 + |v_y|^2 - 2 v_x.v_y (one matmul, like torch.cdist) in float64, whose rounding lies far
    below eps and COINCIDING: coinciding pairs (the self pairs among them) are an exact 0 with no gradient.
    """
    num_keys = value.shape[-2]
    flat = value.flatten(0, -3).double()  # (B * H, Nk, dv)
    v_query = flat[:, num_keys - num_queries :]  # (BH, Nq, dv)
    sq_norm = flat.square().sum(-1)  # (BH, Nk)
    sq_query = sq_norm[:, num_keys - num_queries :, None]  # (BH, Nq, 1)
    d2 = torch.baddbmm(sq_norm[:, None, :], v_query, flat.transpose(1, 2), alpha=-2).add_(sq_query)
    coinciding = d2 <= COINCIDING * (sq_query + sq_norm[:, None, :])  # (BH, Nq, Nk), self pairs included
    return torch.where(coinciding, 0.0, d2).to(value.dtype).unflatten(0, value.shape[:-2])  # (B, H, Nq, Nk)


def plap_attention_weights(
    query, key, value, p, *, attn_mask=None, is_causal=False, document_ids=None, eps=1e-6, formulation="paper"
):
    """The effective attention matrix M with U = M V, (B, H, Nq, Nk) in float32 (float64 for float64 inputs).

    paper: M = A * P.  euler: M = W_off + diag(1 - rowsum(W_off)) with W_off = A * P off the self pairs.
    ``p`` is a sequence of floats or an (H,) tensor (which may require grad). Rows whose every key is masked
    are zero. Inputs are assumed checked (see ``plap_dispatch.plap_attention``).
    """
    with torch.autocast(query.device.type, enabled=False):  # autocast would run the matmuls in half precision
        compute_dtype = torch.promote_types(query.dtype, torch.float32)
        q, k, v = query.to(compute_dtype), key.to(compute_dtype), value.to(compute_dtype)
        num_queries, num_keys = q.shape[-2], k.shape[-2]
        allowed = allowed_positions(attn_mask, is_causal, num_queries, num_keys, q.device, document_ids)
        own = self_pairs(num_queries, num_keys, q.device)
        kind = FORMULATIONS[formulation]

        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, Nq, Nk)
        if allowed is not None:
            # A finite fill (not -inf) keeps fully masked rows free of NaN in forward and backward.
            scores = scores.masked_fill(~allowed, torch.finfo(compute_dtype).min)
        attn = torch.softmax(scores, dim=-1)

        p = p.to(q.device, compute_dtype) if torch.is_tensor(p) else torch.tensor(p, dtype=compute_dtype, device=q.device)
        exponent = ((p - 2) / 2).view(1, -1, 1, 1)  # (1, H, 1, 1)
        d2 = squared_value_distances(v, num_queries) if kind.weights_others else torch.zeros_like(attn)
        if allowed is not None:
            d2 = torch.where(allowed, d2, 1.0)  # excluded before the power: no inf * 0 anywhere
        plap = (d2 + eps).pow(exponent)  # (B, H, Nq, Nk)
        if not kind.weights_others:
            plap = torch.where(own, plap, 1.0)
        if kind.self_pair == "one":
            plap = torch.where(own, 1.0, plap)
        weights = attn * plap

        if kind.self_pair == "euler":
            weights = torch.where(own, 0.0, weights)
            weights = weights + torch.where(own, 1 - weights.sum(-1, keepdim=True), 0.0)
        if allowed is not None:
            weights = torch.where(allowed.any(-1, keepdim=True), weights, 0.0)
        return weights


def plap_attention_eager(
    query,
    key,
    value,
    *,
    p,
    attn_mask=None,
    is_causal=False,
    document_ids=None,
    eps=1e-6,
    formulation="paper",
    dropout=0.0,
    output_attentions=False,
):
    """U = dropout(M) V from the effective weights above, and M itself when ``output_attentions``.

    The one backend that holds (B, H, Nq, Nk) tensors, differentiates p, and applies attention dropout
    (``dropout`` is the probability, 0 outside training). Returns ``(out, weights or None)``, both in
    ``query``'s dtype.
    """
    weights = plap_attention_weights(
        query, key, value, p, attn_mask=attn_mask, is_causal=is_causal, document_ids=document_ids, eps=eps,
        formulation=formulation,
    )  # fmt: skip
    if dropout > 0:
        weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    with torch.autocast(query.device.type, enabled=False):
        out = (weights @ value.to(weights.dtype)).to(query.dtype)  # (B, H, Nq, dv)
    return out, weights.to(query.dtype) if output_attentions else None
