"""An independent float64 reference of p-Laplacian attention, written by direct differences.

Deliberately naive (loops over nothing clever, no matmul expansion of distances) so that it shares no
code or tricks with modeling_plat.plap_attention.
"""

import torch


def reference_plap_attention(query, key, value, p, attn_mask=None, is_causal=False, eps=1e-6, formulation="paper",
                             document_ids=None):
    q, k, v = (t.double() for t in (query, key, value))
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    offset = num_keys - num_queries
    # Everything on the inputs' device and nothing read on the host: the suite checks GPUs with this reference.
    query_pos = torch.arange(num_queries, device=q.device)[:, None] + offset  # each query's own key position
    key_pos = torch.arange(num_keys, device=q.device)[None, :]
    allowed = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = key_pos <= query_pos
    if attn_mask is not None:
        allowed = allowed & attn_mask
    allowed = allowed.expand(q.shape[0], q.shape[1], num_queries, num_keys)
    if document_ids is not None:
        same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, N, N)
        allowed = allowed & same[:, None]

    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = torch.where(allowed, scores, -1e300)
    attn = torch.softmax(scores, dim=-1) * allowed

    v_x = v[:, :, offset:]  # (B, H, Nq, dv): each query's own value
    diff = v_x[:, :, :, None, :] - v[:, :, None, :, :]  # (B, H, Nq, Nk, dv)
    d2 = (diff**2).sum(-1)
    self_pair = key_pos == query_pos
    d2 = torch.where(self_pair, torch.zeros_like(d2), d2)
    exponent = ((torch.as_tensor(p, dtype=torch.float64, device=q.device) - 2) / 2).view(1, -1, 1, 1)
    plap = torch.where(allowed, d2 + eps, torch.ones_like(d2)) ** exponent
    if formulation == "noself":  # the other tokens' p-Laplacian weights alone
        plap = torch.where(self_pair, torch.ones_like(plap), plap)
    if formulation == "selfweight":  # eq. 12's self-weight eps^((p - 2) / 2) alone
        plap = torch.where(self_pair, eps**exponent * torch.ones_like(plap), torch.ones_like(plap))
    weights = attn * plap

    if formulation != "euler":
        out = weights @ v
    else:
        off = torch.where(self_pair, torch.zeros_like(weights), weights)
        # u_x = v_x + sum_{y != x} W[x, y] (v_y - v_x)
        out = v_x + (off[..., None] * (v[:, :, None, :, :] - v_x[:, :, :, None, :])).sum(-2)
    row_valid = allowed.any(-1, keepdim=True)
    return torch.where(row_valid, out, torch.zeros_like(out))
