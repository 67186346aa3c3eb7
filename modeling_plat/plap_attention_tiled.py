"""Memory-efficient p-Laplacian attention in plain PyTorch: tiled forward, recomputing backward.

Same maths as ``plap_attention.plap_attention_weights`` (see its module docstring), computed tile by tile
so that no (B, H, Nq, Nk) tensor is ever held:

- forward: the queries of a batch block are split into query blocks and the keys into key blocks; the
  softmax is online (running row max ``m`` and sum ``l`` in float32). The softmax is normalised before
  the p-Laplacian weight P multiplies it, so the denominator accumulates exp(s - m) alone and the
  numerator exp(s - m) * P @ V.
- backward: recomputes each tile from q, k, v and the saved row logsumexp; saves only O(N) per row
  (the output, the logsumexp and, for euler, the row sum of W_off).

Backward (per head, A = softmax(S), W = A * P, dU the output gradient, G = dU V^T, c = (p - 2) / 2):
    paper:  dW = G                      Drow = rowsum(W * dW) = rowsum(dU * U)
    euler:  dW = G - dU.v_x, 0 on self  Drow = rowsum(dU * (U - v_x)), and dv_x += dU (1 - rowsum W_off)
    dV  += W_used^T dU                  (W_used = W, or W_off for euler)
    dS   = W_used * dW - A * Drow       (softmax backward; dq = dS k / sqrt(d), dk = dS^T q / sqrt(d))
    Gd   = dL/dD2 = c (D2 + eps)^(c - 1) * A * dW_used = c * W_used * dW / (D2 + eps), 0 on self pairs
    dv_x += 2 (rowsum(Gd) v_x - Gd V),  dV += 2 (colsum(Gd) V - Gd^T V_q)     (D2 = |v_x - v_y|^2)

The gradient with respect to p is not computed: p is a fixed buffer in p-LaT models. ``plap_attention``
routes a ``p`` that requires grad to the eager backend under "auto"; this module refuses it.
"""

import math

import torch

from .plap_attention import float32_baddbmm

# Scores per tile, all heads of a batch block together: 2**18 float32 = 1 MiB, so that the dozen
# elementwise passes over a tile run in cache, while the matmuls stay large enough to be efficient.
TILE_ELEMENTS = 1 << 18
# Longest key block. Shorter sequences take all their keys in one block (no online rescaling);
# longer ones are split so that a tile's rows stay long enough for efficient matmuls.
MAX_BLOCK_K = 1024
# Lower bound on the exponents of the softmax: PyTorch's vectorised CPU exp takes a ~50x slower path
# for inputs whose result is below float32's smallest normal (~exp(-87.3)), and ~3x for -inf (masked
# scores). Clamping costs a cheap pass and only lifts weights below 1.6e-38 (masked pairs included) to
# 1.6e-38, far below rounding; rows with no allowed key are recognised by their running max instead.
MIN_EXPONENT = -87.0
# Causal query blocks are kept short so that the key range of each (cut at the diagonal) skips most of
# the masked upper triangle.
CAUSAL_BLOCK_Q = 64


def _block_sizes(batch, heads, num_queries, num_keys, is_causal):
    """(batch block, query block, key block) sizes for a tile of about TILE_ELEMENTS scores."""
    block_k = min(num_keys, MAX_BLOCK_K)
    block_q = max(16, TILE_ELEMENTS // (heads * block_k))
    if is_causal:
        block_q = min(block_q, CAUSAL_BLOCK_Q)
    block_q = min(block_q, num_queries)
    block_b = min(batch, max(1, TILE_ELEMENTS // (heads * block_q * block_k)))
    return block_b, block_q, block_k


def _exponent_runs(exponents):
    """Runs of consecutive heads sharing one exponent c = (p - 2) / 2, as (first head, end, c)."""
    runs = []
    for head, c in enumerate(exponents):
        if runs and runs[-1][2] == c:
            runs[-1] = (runs[-1][0], head + 1, c)
        else:
            runs.append((head, head + 1, c))
    return tuple(runs)


def _power(base, runs, heads):
    """base ** c per head, base of shape (bb * H, bq, bk); square-root chains where c allows (p = 1, 1.5, 2.5, 3)."""
    out = torch.empty_like(base)
    base4, out4 = base.unflatten(0, (-1, heads)), out.unflatten(0, (-1, heads))  # (bb, H, bq, bk)
    for first, end, c in runs:
        x, y = base4[:, first:end], out4[:, first:end]
        if c == 0:
            y.fill_(1)
        elif c == 0.25:
            torch.sqrt(x, out=y).sqrt_()
        elif c == -0.25:
            torch.sqrt(x, out=y).rsqrt_()
        elif c == 0.5:
            torch.sqrt(x, out=y)
        elif c == -0.5:
            torch.rsqrt(x, out=y)
        else:
            torch.pow(x, c, out=y)
    return out


def _narrow(tensor, dim, start, end):
    """tensor[start:end] along dim, unless that dim is broadcast (size 1)."""
    return tensor if tensor.shape[dim] == 1 else tensor.narrow(dim, start, end - start)


class _Tiling:
    """Tile geometry and the per-tile recomputations shared by forward and backward.

    Tensors are flattened to (B * H, N, d); a batch block [b0, b1) is the row range [b0 * H, b1 * H).
    """

    def __init__(self, query, key, value, runs, bias, is_causal, eps, euler, blocks):
        self.batch, self.heads, self.num_queries, head_dim = query.shape
        self.num_keys = key.shape[2]
        self.offset = self.num_keys - self.num_queries  # query i is the token at key position offset + i
        self.scale = 1 / math.sqrt(head_dim)
        self.runs, self.bias, self.is_causal, self.eps, self.euler = runs, bias, is_causal, eps, euler
        self.needs_distance = any(c != 0 for _, _, c in runs)
        self.block_b, self.block_q, self.block_k = blocks
        self._causal_biases = {}
        self.q = (query * self.scale).flatten(0, 1)  # (BH, Nq, d), pre-scaled
        self.k = key.flatten(0, 1)  # (BH, Nk, d)
        self.v = value.flatten(0, 1)  # (BH, Nk, dv)
        self.v_query = self.v[:, self.offset :]  # (BH, Nq, dv): each query's own value
        if self.needs_distance:
            self.sq_norm = self.v.pow(2).sum(-1)  # (BH, Nk)
            self.sq_norm_query_eps = self.sq_norm[:, self.offset :] + eps  # (BH, Nq)
            self.c = torch.tensor([c for first, end, c in runs for _ in range(first, end)], dtype=query.dtype)
            self.c = self.c.to(query.device).view(1, -1, 1, 1)  # (1, H, 1, 1)

    def query_blocks(self):
        for b0 in range(0, self.batch, self.block_b):
            b1 = min(b0 + self.block_b, self.batch)
            for q0 in range(0, self.num_queries, self.block_q):
                yield b0, b1, slice(b0 * self.heads, b1 * self.heads), q0, min(q0 + self.block_q, self.num_queries)

    def key_blocks(self, q0, q1):
        # Under the causal mask no query of [q0, q1) sees a key past position offset + q1 - 1.
        end = min(self.num_keys, self.offset + q1) if self.is_causal else self.num_keys
        for k0 in range(0, end, self.block_k):
            yield k0, min(k0 + self.block_k, end)

    def self_diagonal(self, tile, q0, k0):
        """View of a (bh, bq, bk) tile's self pairs (query q0 + i against key offset + q0 + i)."""
        return torch.diagonal(tile, offset=self.offset + q0 - k0, dim1=1, dim2=2)

    def scores(self, rows, b0, b1, q0, q1, k0, k1):
        """Scaled, masked scores of a tile, (bh, bq, bk); masked pairs are -inf."""
        scores = torch.bmm(self.q[rows, q0:q1], self.k[rows, k0:k1].transpose(1, 2))  # (bh, bq, bk)
        if self.bias is not None:
            bias = _narrow(_narrow(_narrow(self.bias, 0, b0, b1), 2, q0, q1), 3, k0, k1)
            scores.unflatten(0, (-1, self.heads)).add_(bias)
        if self.is_causal and k1 - 1 > self.offset + q0:  # the tile crosses the diagonal
            scores.add_(self.causal_bias(self.offset + q0 - k0, q1 - q0, k1 - k0))
        return scores

    def causal_bias(self, diagonal, rows, cols):
        """(rows, cols) float tile, -inf above the given diagonal: an add is much cheaper than masked_fill."""
        key = (diagonal, rows, cols)
        if key not in self._causal_biases:
            query_pos = torch.arange(rows, device=self.q.device) + diagonal
            above = torch.arange(cols, device=self.q.device)[None, :] > query_pos[:, None]
            self._causal_biases[key] = torch.zeros(rows, cols, dtype=self.q.dtype, device=self.q.device).masked_fill_(
                above, -math.inf
            )
        return self._causal_biases[key]

    def distances_eps(self, rows, q0, q1, k0, k1):
        """D2 + eps of a tile, (bh, bq, bk), from |v_x|^2 + |v_y|^2 - 2 v_x.v_y; self pairs exactly eps."""
        dist = float32_baddbmm(
            self.sq_norm[rows, None, k0:k1], self.v_query[rows, q0:q1], self.v[rows, k0:k1].transpose(1, 2), alpha=-2
        )  # (bh, bq, bk)
        dist.add_(self.sq_norm_query_eps[rows, q0:q1, None]).clamp_min_(self.eps)
        self.self_diagonal(dist, q0, k0).fill_(self.eps)
        return dist


def _forward(tiling):
    """Output (BH, Nq, dv), row logsumexp (BH, Nq; +inf on fully masked rows), rowsum(W_off) for euler."""
    t = tiling
    bh_all, dtype = t.q.shape[0], t.q.dtype
    out = t.q.new_empty(bh_all, t.num_queries, t.v.shape[-1])
    lse = t.q.new_empty(bh_all, t.num_queries)
    off_rowsum = t.q.new_empty(bh_all, t.num_queries) if t.euler else None
    for b0, b1, rows, q0, q1 in t.query_blocks():
        first = True
        for k0, k1 in t.key_blocks(q0, q1):
            weights = t.scores(rows, b0, b1, q0, q1, k0, k1)
            tile_max = weights.amax(-1, keepdim=True)  # (bh, bq, 1)
            # The running max starts at the lowest finite value, so rows masked so far give exp(-inf) = 0.
            new_max = tile_max.clamp_min(torch.finfo(dtype).min) if first else torch.maximum(row_max, tile_max)
            weights.sub_(new_max).clamp_min_(MIN_EXPONENT).exp_()
            tile_sum = weights.sum(-1, keepdim=True)
            if t.needs_distance:
                weights.mul_(_power(t.distances_eps(rows, q0, q1, k0, k1), t.runs, t.heads))
            if t.euler:
                t.self_diagonal(weights, q0, k0).fill_(0)
            values = t.v[rows, k0:k1]
            if first:
                row_sum, acc = tile_sum, torch.bmm(weights, values)  # (bh, bq, 1), (bh, bq, dv)
                w_sum = weights.sum(-1, keepdim=True) if t.euler else None
            else:
                rescale = torch.exp(row_max - new_max)
                row_sum = row_sum.mul_(rescale).add_(tile_sum)
                acc.mul_(rescale).baddbmm_(weights, values)
                if t.euler:
                    w_sum.mul_(rescale).add_(weights.sum(-1, keepdim=True))
            row_max, first = new_max, False
        valid = row_max > torch.finfo(dtype).min  # rows with at least one key allowed; the others output zeros
        inv_sum = torch.where(valid, row_sum.reciprocal(), 0)  # exact zeros, not 1.6e-38-weighted means
        out_block = acc.mul_(inv_sum)
        if t.euler:
            w_sum.mul_(inv_sum)  # rowsum(W_off), 0 on fully masked rows
            out_block.addcmul_(torch.where(valid, 1 - w_sum, 0), t.v_query[rows, q0:q1])
            off_rowsum[rows, q0:q1] = w_sum.squeeze(-1)
        out[rows, q0:q1] = out_block
        lse[rows, q0:q1] = torch.where(valid, row_max + row_sum.log(), math.inf).squeeze(-1)
    return out, lse, off_rowsum


def _backward(tiling, out, lse, off_rowsum, grad_out):
    """Gradients (BH, N, d) of q, k, v from the saved O(N) statistics, recomputing every tile."""
    t = tiling
    grad_out = grad_out.masked_fill(torch.isinf(lse)[..., None], 0)  # fully masked rows are constant zeros
    if t.euler:
        # dU_x . v_x is the part of G that the subtraction of rowsum(W_off) v_x takes back.
        grad_own = (grad_out * t.v_query).sum(-1)  # (BH, Nq)
        row_dot = (grad_out * out).sum(-1) - grad_own
    else:
        row_dot = (grad_out * out).sum(-1)  # rowsum(W * dW) = dU . U, FlashAttention's D
    grad_q = torch.empty_like(t.q)
    grad_k = torch.zeros_like(t.k)
    grad_v = torch.zeros_like(t.v)
    for b0, b1, rows, q0, q1 in t.query_blocks():
        grad_out_block = grad_out[rows, q0:q1]  # (bh, bq, dv)
        v_query = t.v_query[rows, q0:q1]
        # Accumulators of this query block, contiguous: in-place matmuls into strided views are slow.
        grad_q_block = t.q.new_zeros(grad_out_block.shape[:2] + t.q.shape[-1:])  # (bh, bq, d)
        if t.needs_distance:
            grad_v_own = torch.zeros_like(grad_out_block)  # - sum_y Gd V, then + rowsum(Gd) v_x
            gd_rowsum = v_query.new_zeros(v_query.shape[:2])
        for k0, k1 in t.key_blocks(q0, q1):
            attn = t.scores(rows, b0, b1, q0, q1, k0, k1).sub_(lse[rows, q0:q1, None])
            attn = attn.clamp_min_(MIN_EXPONENT).exp_()  # (bh, bq, bk); ~0 on fully masked rows, whose dU is 0
            if t.needs_distance:
                dist = t.distances_eps(rows, q0, q1, k0, k1)
                weights = _power(dist, t.runs, t.heads).mul_(attn)
            else:
                weights = attn.clone() if t.euler else attn
            if t.euler:
                t.self_diagonal(weights, q0, k0).fill_(0)
            keys, values = t.k[rows, k0:k1], t.v[rows, k0:k1]
            grad_v_keys = torch.bmm(weights.transpose(1, 2), grad_out_block)  # (bh, bk, dv)
            grad_w = torch.bmm(grad_out_block, values.transpose(1, 2))  # G, (bh, bq, bk)
            if t.euler:
                grad_w.sub_(grad_own[rows, q0:q1, None])
            grad_w.mul_(weights)  # W * dW
            grad_s = attn.mul_(row_dot[rows, q0:q1, None].neg()).add_(grad_w)  # dS, (bh, bq, bk)
            grad_q_block.baddbmm_(grad_s, keys)
            grad_k[rows, k0:k1] += torch.bmm(grad_s.transpose(1, 2), t.q[rows, q0:q1])
            if t.needs_distance:
                grad_dist = grad_w.div_(dist)
                grad_dist.unflatten(0, (-1, t.heads)).mul_(2 * t.c)  # 2 dL/dD2, (bh, bq, bk)
                t.self_diagonal(grad_dist, q0, k0).fill_(0)
                grad_v_own.baddbmm_(grad_dist, values, alpha=-1)
                gd_rowsum.add_(grad_dist.sum(-1))
                grad_v_keys.addcmul_(grad_dist.sum(1)[..., None], values)
                grad_v_keys.baddbmm_(grad_dist.transpose(1, 2), v_query, alpha=-1)
            grad_v[rows, k0:k1] += grad_v_keys
        grad_q[rows, q0:q1] = grad_q_block
        if t.needs_distance:
            own = slice(t.offset + q0, t.offset + q1)
            grad_v[rows, own] += grad_v_own.addcmul_(gd_rowsum[..., None], v_query)
    grad_q.mul_(t.scale)  # dk needs no such factor: it was taken against the pre-scaled queries
    if t.euler:
        grad_v[:, t.offset :].addcmul_(grad_out, (1 - off_rowsum)[..., None])
    return grad_q, grad_k, grad_v


class _PlapAttentionTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, runs, bias, is_causal, eps, euler, blocks):
        tiling = _Tiling(query, key, value, runs, bias, is_causal, eps, euler, blocks)
        out, lse, off_rowsum = _forward(tiling)
        ctx.save_for_backward(query, key, value, out, lse, off_rowsum)
        ctx.args = (runs, bias, is_causal, eps, euler, blocks)
        return out.view(query.shape[:3] + value.shape[-1:])  # (B, H, Nq, dv)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, off_rowsum = ctx.saved_tensors
        with torch.autocast(query.device.type, enabled=False):
            tiling = _Tiling(query, key, value, *ctx.args)
            grads = _backward(tiling, out, lse, off_rowsum, grad_out.flatten(0, 1).to(out.dtype))
        grad_q, grad_k, grad_v = (g.view(x.shape) for g, x in zip(grads, (query, key, value)))
        return grad_q, grad_k, grad_v, None, None, None, None, None, None


def plap_attention_tiled(
    query, key, value, p, attn_mask=None, is_causal=False, eps=1e-6, formulation="paper", blocks=None
):
    """p-Laplacian attention with O(N) extra memory; arguments as ``plap_attention`` (inputs checked there).

    ``p`` is an (H,) tensor and gets no gradient. ``blocks`` = (batch, query, key) block sizes overrides
    the automatic choice (tests use small blocks to exercise the online softmax). The exponents are read
    on the host, which synchronises a GPU once per call.
    """
    if p.requires_grad and torch.is_grad_enabled():
        raise ValueError("the tiled backend computes no gradient for p; use backend='eager' to train p")
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    batch, heads, num_queries, _ = query.shape
    num_keys = key.shape[2]
    exponents = ((p.detach().to(torch.float64).cpu() - 2) / 2).tolist()
    bias = None
    if attn_mask is not None:
        mask = attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))  # (B|1, H|1, Nq|1, Nk|1)
        bias = torch.zeros(mask.shape, dtype=compute_dtype, device=query.device).masked_fill_(~mask, -math.inf)
    if blocks is None:
        blocks = _block_sizes(batch, heads, num_queries, num_keys, is_causal)
    # P and every accumulation run in float32 (float64 for float64 inputs), also under autocast.
    with torch.autocast(query.device.type, enabled=False):
        out = _PlapAttentionTiled.apply(
            query.to(compute_dtype).contiguous(),
            key.to(compute_dtype).contiguous(),
            value.to(compute_dtype).contiguous(),
            _exponent_runs(exponents),
            bias,
            is_causal,
            eps,
            formulation == "euler",
            blocks,
        )
    return out.to(query.dtype)
