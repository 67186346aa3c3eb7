"""Memory-efficient p-Laplacian attention in plain PyTorch: tiled forward, recomputing backward.

Same maths as ``plap_attention_reference.plap_attention_weights`` (see its module docstring), computed tile by tile
so that no (B, H, Nq, Nk) tensor is ever held:

- forward: the queries of a batch block are split into query blocks and the keys into key blocks; the
  softmax is online (running row max ``m`` and sum ``l`` in float32). The softmax is normalised before
  the p-Laplacian weight P multiplies it, so the denominator accumulates exp(s - m) alone and the
  numerator exp(s - m) * P @ V.
- backward: recomputes each tile from q, k, v and the saved row logsumexp; saves only O(N) per row
  (the output, the logsumexp and, for euler, the row sum of W_off).

Backward (per head, A = softmax(S), W = A * P, Z = D2 + eps, dU the output gradient, G = dU V^T,
c = (p - 2) / 2):
    paper:  dW = G                      Drow = rowsum(W * dW) = rowsum(dU * U)
    euler:  dW = G - dU.v_x, 0 on self  Drow = rowsum(dU * (U - v_x)), and dv_x += dU (1 - rowsum W_off)
    dV  += W_used^T dU                  (W_used = W, or W_off for euler)
    T    = W_used * dW
    dS   = T - A * Drow                 (softmax backward; dq = dS k / sqrt(d), dk = dS^T q / sqrt(d))
    Gd   = dL/dD2 = c (D2 + eps)^(c - 1) * A * dW_used = c * Y with Y = T / Z, 0 on self pairs
    dv_x += 2 c (rowsum(Y) v_x - Y V),  dV += 2 c (colsum(Y) V - Y^T V_q)     (D2 = |v_x - v_y|^2)

Where CPU time goes (per-op CPU time, paper LM and DeiT-tiny shapes, one core): the matmuls, 11 per tile
against SDPA's 7, take about half at head size 16 and three quarters at 64; the rest is elementwise passes
over the tiles and Python's per-call cost. Hence:
- scores are kept in log2 units (the queries are pre-scaled by log2(e) / sqrt(d)) so that the softmax uses
  exp2, which PyTorch vectorises itself on every x86 CPU; exp goes to MKL's vector maths where MKL is linked,
  4x slower on AMD CPUs and 20x for results below float32's normal range (see ``_power`` for the powers);
- each tile is written once by a matmul and then updated in place (A becomes dS, G becomes T then Y), in a
  few scratch buffers allocated once per call; the backward forms four tiles per step (A, D2 + eps, W, G);
- no (B, H, N, d) temporaries beyond the outputs: the score scale rides in the matmul's alpha, row sums and
  the 2 c factor of the distance gradient are applied per query block. Fresh multi-MiB tensors cost page
  faults on every call (~20% of the DeiT-tiny fwd+bwd before this, in system time).

The gradient with respect to p is not computed: p is a fixed buffer in p-LaT models. ``plap_attention``
routes a ``p`` that requires grad to the eager backend under "auto"; this module refuses it.
"""

import math

import torch

from .custom_ops import FusedOp, op_name
from .float32_matmul import float32_baddbmm_
from .head_runs import head_runs, one_value
from .plap_attention_reference import CLOSE_PAIR, COINCIDING, formulation_of, implemented

FORMULATIONS = implemented("paper", "euler")

# Scores per tile (1 MiB of float32): small enough for the cache, large enough to amortise per-call overhead
# (docs/performance.md; re-derive with `python benchmarks/bench_attention.py --backends tiled`).
TILE_ELEMENTS = 1 << 18
# Longest key block. Shorter sequences take all their keys in one block (no online rescaling);
# longer ones are split so that a tile's rows stay long enough for efficient matmuls.
MAX_BLOCK_K = 1024
# Short causal query blocks let each block's key range, cut at the diagonal, skip most of the masked triangle
# (docs/performance.md; same benchmark).
CAUSAL_BLOCKS_PER_SEQUENCE = 8
MIN_CAUSAL_BLOCK_Q = 32
LOG2_E = 1 / math.log(2)


def _block_sizes(batch, heads, num_queries, num_keys, is_causal):
    """(batch block, query block, key block) sizes for a tile of about TILE_ELEMENTS scores."""
    block_k = min(num_keys, MAX_BLOCK_K)
    block_q = max(16, TILE_ELEMENTS // (heads * block_k))
    if is_causal:
        block_q = min(block_q, max(MIN_CAUSAL_BLOCK_Q, num_queries // CAUSAL_BLOCKS_PER_SEQUENCE))
    block_q = min(block_q, num_queries)
    block_b = min(batch, max(1, TILE_ELEMENTS // (heads * block_q * block_k)))
    return block_b, block_q, block_k


def _power(base, out, runs, heads):
    """out = base ** c per head, (bb * H, bq, bk) tiles, base > 0; out may be base (so each chain reads base once).

    Chains of rsqrt where c allows (p = 1, 1.5, 2.5, 3). PyTorch evaluates rsqrt, exp2 and arithmetic with its
    own vector code on every x86 CPU, while sqrt, exp, log and pow go to MKL's vector maths where MKL is
    linked, whose speed depends on the CPU vendor: on one AMD EPYC core per float32, rsqrt 0.28 ns,
    sqrt 0.42 ns, pow 1.9 ns (pow 8 ns with AVX2 kernels).
    """
    base4, out4 = base.unflatten(0, (-1, heads)), out.unflatten(0, (-1, heads))  # (bb, H, bq, bk)
    for first, end, c in runs:
        x, y = base4[:, first:end], out4[:, first:end]
        if c == 0:
            y.fill_(1)
        elif c == 0.25:
            torch.rsqrt(x, out=y).rsqrt_()
        elif c == -0.25:
            torch.rsqrt(x, out=y).rsqrt_().reciprocal_()
        elif c == 0.5:
            torch.rsqrt(x, out=y).reciprocal_()
        elif c == -0.5:
            torch.rsqrt(x, out=y)
        else:
            torch.pow(x, c, out=y)
    return out


def _narrow(tensor, dim, start, end):
    """tensor[start:end] along dim, unless that dim is broadcast (size 1)."""
    return tensor if tensor.shape[dim] == 1 else tensor.narrow(dim, start, end - start)


def _tile(buffer, *shape):
    """A contiguous view of the first elements of a flat scratch buffer: tiles reuse memory, never allocate."""
    return buffer[: math.prod(shape)].view(shape)


class _Documents:
    """Where each token's document lies in a packed row, read once per call on the host (the loops need it)."""

    def __init__(self, document_ids):
        self.ids = document_ids  # (B, N), on the inputs' device
        ids = document_ids.to("cpu", torch.long)
        _, index = torch.unique(ids, return_inverse=True)  # documents renumbered 0 .. D - 1
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        first = torch.full((ids.shape[0], int(index.max()) + 1), ids.shape[1]).scatter_reduce(1, index, positions, "amin")
        last = torch.full_like(first, -1).scatter_reduce(1, index, positions, "amax")
        self.start = first.gather(1, index)  # (B, N): first position of each token's document
        self.end = last.gather(1, index) + 1  # (B, N): one past its last position
        self.host_ids = ids

    def key_range(self, b0, b1, q0, q1):
        """Keys [start, end) that some query of the block may see."""
        return int(self.start[b0:b1, q0:q1].min()), int(self.end[b0:b1, q0:q1].max())

    def mask_tile(self, scores, b0, b1, q0, q1, k0, k1):
        """-inf on the pairs of a (bb, H, bq, bk) tile that lie in different documents; nothing to do (and
        nothing paid) when the tile's queries and keys share one document in every row."""
        ids = torch.cat((self.host_ids[b0:b1, q0:q1], self.host_ids[b0:b1, k0:k1]), 1)
        if bool((ids.amax(1) == ids.amin(1)).all()):
            return
        other = self.ids[b0:b1, q0:q1, None] != self.ids[b0:b1, None, k0:k1]  # (bb, bq, bk)
        scores.masked_fill_(other[:, None], -math.inf)


class _Tiling:
    """Tile geometry and the per-tile recomputations shared by forward and backward.

    Tensors are flattened to (B * H, N, d); a batch block [b0, b1) is the row range [b0 * H, b1 * H).
    """

    def __init__(self, query, key, value, exponents, bias, document_ids, is_causal, eps, euler, blocks):
        self.batch, self.heads, self.num_queries, head_dim = query.shape
        self.num_keys = key.shape[2]
        self.offset = self.num_keys - self.num_queries  # query i is the token at key position offset + i
        self.scale = 1 / math.sqrt(head_dim)
        self.runs = tuple((first, end, exponents[first]) for first, end in head_runs(exponents, one_value))
        self.bias, self.is_causal, self.eps, self.euler = bias, is_causal, eps, euler
        if blocks is None:
            blocks = _block_sizes(self.batch, self.heads, self.num_queries, self.num_keys, is_causal)
        self.block_b, self.block_q, self.block_k = blocks
        self.documents = None if document_ids is None else _Documents(document_ids)
        self._causal_biases = {}
        self.q = query.flatten(0, 1)  # (BH, Nq, d)
        self.k = key.flatten(0, 1)  # (BH, Nk, d)
        self.v = value.flatten(0, 1)  # (BH, Nk, dv)
        self.v_query = self.v[:, self.offset :]  # (BH, Nq, dv): each query's own value
        self.sq_norm = self.v.pow(2).sum(-1)  # (BH, Nk)
        self.sq_norm_query_eps = self.sq_norm[:, self.offset :] + eps  # (BH, Nq)
        self.close_bound = (CLOSE_PAIR * self.sq_norm_query_eps + eps)[..., None]  # (BH, Nq, 1), on D2 + eps
        self.close_buffer = torch.empty(self.block_b * self.heads * self.block_q * self.block_k, dtype=torch.bool,
                                        device=query.device)  # fmt: skip

    def new_tile_buffer(self):
        """Scratch memory for one tile, reused by every tile of a call."""
        return self.q.new_empty(self.block_b * self.heads * self.block_q * self.block_k)

    def query_blocks(self):
        for b0 in range(0, self.batch, self.block_b):
            b1 = min(b0 + self.block_b, self.batch)
            for q0 in range(0, self.num_queries, self.block_q):
                yield b0, b1, slice(b0 * self.heads, b1 * self.heads), q0, min(q0 + self.block_q, self.num_queries)

    def key_blocks(self, b0, b1, q0, q1):
        # Under the causal mask no query of [q0, q1) sees a key past position offset + q1 - 1; in a packed row
        # none sees a key outside the documents of its queries.
        start, end = 0, self.num_keys
        if self.documents is not None:
            start, end = self.documents.key_range(b0, b1, q0, q1)
        if self.is_causal:
            end = min(end, self.offset + q1)
        for k0 in range(start, end, self.block_k):
            yield k0, min(k0 + self.block_k, end)

    def self_diagonal(self, tile, q0, k0):
        """View of a (bh, bq, bk) tile's self pairs (query q0 + i against key offset + q0 + i)."""
        return torch.diagonal(tile, offset=self.offset + q0 - k0, dim1=1, dim2=2)

    def scores(self, rows, b0, b1, q0, q1, k0, k1, buffer):
        """Scaled, masked scores of a tile in log2 units, (bh, bq, bk) in ``buffer``; masked pairs are -inf."""
        scores = _tile(buffer, rows.stop - rows.start, q1 - q0, k1 - k0).baddbmm_(
            self.q[rows, q0:q1], self.k[rows, k0:k1].transpose(1, 2), beta=0, alpha=self.scale * LOG2_E
        )  # (bh, bq, bk); beta=0 ignores the buffer's old contents
        if self.bias is not None:
            bias = _narrow(_narrow(_narrow(self.bias, 0, b0, b1), 2, q0, q1), 3, k0, k1)
            scores.unflatten(0, (-1, self.heads)).add_(bias)
        if self.is_causal and k1 - 1 > self.offset + q0:  # the tile crosses the diagonal
            scores.add_(self.causal_bias(self.offset + q0 - k0, q1 - q0, k1 - k0))
        if self.documents is not None:
            self.documents.mask_tile(scores.unflatten(0, (-1, self.heads)), b0, b1, q0, q1, k0, k1)
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

    def distances_eps(self, rows, q0, q1, k0, k1, buffer):
        """D2 + eps of a tile, (bh, bq, bk) in ``buffer``, and the indices of its coinciding pairs other than the self
        pairs (None when it has none): the one place where distances are formed.

        |v_x|^2 + eps + |v_y|^2 (one broadcast add) - 2 v_x.v_y (one matmul accumulating onto it, float32-exact
        under CUDA TF32), like torch.cdist. Its rounding, a few u (|v_x|^2 + |v_y|^2), would decide P where values
        (nearly) coincide: the close pairs (CLOSE_PAIR, the only ones it can take below eps) are recomputed by
        direct differences; coinciding pairs (COINCIDING) and self pairs are exactly eps.
        """
        shape = (rows.stop - rows.start, q1 - q0, k1 - k0)
        dist = torch.add(
            self.sq_norm_query_eps[rows, q0:q1, None], self.sq_norm[rows, None, k0:k1], out=_tile(buffer, *shape)
        )  # (bh, bq, bk)
        float32_baddbmm_(dist, self.v_query[rows, q0:q1], self.v[rows, k0:k1].transpose(1, 2), alpha=-2)
        # Most tiles have no close pair: one reading pass (the row minima, self pairs left out) tells, before the
        # compare that writes a mask.
        diagonal = self.self_diagonal(dist, q0, k0)
        diagonal.fill_(math.inf)
        bound = self.close_bound[rows, q0:q1]
        if not bool((dist.amin(-1, keepdim=True) <= bound).any()):
            diagonal.fill_(self.eps)
            return dist, None
        close = torch.le(dist, bound, out=_tile(self.close_buffer, *shape))
        diagonal.fill_(self.eps)
        pair, query, key = close.nonzero(as_tuple=True)  # a few pairs: repeated tokens, near duplicates
        pair, query, key = pair + rows.start, query + q0, key + k0
        exact = (self.v_query[pair, query] - self.v[pair, key]).square_().sum(-1)
        coinciding = exact <= COINCIDING * (self.sq_norm[pair, query + self.offset] + self.sq_norm[pair, key])
        dist[close] = exact.masked_fill_(coinciding, 0).add_(self.eps)
        return dist, tuple(index[coinciding] - start for index, start in zip((pair, query, key), (rows.start, q0, k0)))

    def plap_weights(self, attn, dist, q0, k0, out):
        """W_used = A * (D2 + eps) ** c into ``out`` (which may be ``dist``); self pairs zeroed for euler."""
        weights = _power(dist, out, self.runs, self.heads).mul_(attn)
        if self.euler:
            self.self_diagonal(weights, q0, k0).fill_(0)
        return weights


def _forward(tiling):
    """Output (BH, Nq, dv), row logsumexp in log2 units (BH, Nq; +inf on fully masked rows) and, for euler, the
    weight 1 - rowsum(W_off) of each query's own value (BH, Nq; 0 on fully masked rows)."""
    t = tiling
    bh_all, dtype = t.q.shape[0], t.q.dtype
    out = t.q.new_empty(bh_all, t.num_queries, t.v.shape[-1])
    lse = t.q.new_empty(bh_all, t.num_queries)
    own_weight = t.q.new_empty(bh_all, t.num_queries) if t.euler else None
    scores_buffer, dist_buffer = t.new_tile_buffer(), t.new_tile_buffer()
    for b0, b1, rows, q0, q1 in t.query_blocks():
        first = True
        for k0, k1 in t.key_blocks(b0, b1, q0, q1):
            exp_scores = t.scores(rows, b0, b1, q0, q1, k0, k1, scores_buffer)
            tile_max = exp_scores.amax(-1, keepdim=True)  # (bh, bq, 1)
            # The running max starts at the lowest finite value, so rows masked so far give exp2(-inf) = 0.
            new_max = tile_max.clamp_min(torch.finfo(dtype).min) if first else torch.maximum(row_max, tile_max)
            exp_scores.sub_(new_max).exp2_()
            tile_sum = exp_scores.sum(-1, keepdim=True)
            dist, _ = t.distances_eps(rows, q0, q1, k0, k1, dist_buffer)
            weights = t.plap_weights(exp_scores, dist, q0, k0, out=dist)
            values = t.v[rows, k0:k1]
            if first:
                row_sum, acc = tile_sum, torch.bmm(weights, values)  # (bh, bq, 1), (bh, bq, dv)
                w_sum = weights.sum(-1, keepdim=True) if t.euler else None
            else:
                rescale = torch.exp2(row_max - new_max)
                row_sum = row_sum.mul_(rescale).add_(tile_sum)
                acc.mul_(rescale).baddbmm_(weights, values)
                if t.euler:
                    w_sum.mul_(rescale).add_(weights.sum(-1, keepdim=True))
            row_max, first = new_max, False
        valid = row_max > torch.finfo(dtype).min  # rows with at least one key allowed; the others output zeros
        inv_sum = torch.where(valid, row_sum.reciprocal(), 0)
        out_block = acc.mul_(inv_sum)
        if t.euler:
            own_block = torch.where(valid, 1 - w_sum.mul_(inv_sum), 0)  # 1 - rowsum(W_off), (bh, bq, 1)
            out_block.addcmul_(own_block, t.v_query[rows, q0:q1])
            own_weight[rows, q0:q1] = own_block.squeeze(-1)
        out[rows, q0:q1] = out_block
        lse[rows, q0:q1] = torch.where(valid, row_max + row_sum.log2(), math.inf).squeeze(-1)
    return out, lse, own_weight


def _backward(tiling, out, lse, own_weight, grad_out):
    """Gradients (BH, N, d) of q, k, v from the saved O(N) statistics, recomputing every tile.

    Four tiles per step, each written once and updated in place: A (then dS), D2 + eps, W, G (then T, then Y).
    Rows with no allowed key need no masking: their A, hence W, T, dS and Y, are exact zeros, and so is their
    own_weight.
    """
    t = tiling
    dv = t.v.shape[-1]
    c = torch.tensor([c for first, end, c in t.runs for _ in range(first, end)], dtype=t.v.dtype)
    neg_two_c = (-2 * c).to(t.v.device).repeat(t.batch)[:, None, None]  # (BH, 1, 1)
    grad_q = torch.empty_like(t.q)
    grad_k = torch.zeros_like(t.k)
    grad_v = torch.zeros_like(t.v)
    attn_buffer, dist_buffer, weights_buffer, grad_w_buffer = (t.new_tile_buffer() for _ in range(4))
    for b0, b1, rows, q0, q1 in t.query_blocks():
        bh, bq = rows.stop - rows.start, q1 - q0
        grad_out_block = grad_out[rows, q0:q1]  # (bh, bq, dv)
        own = slice(t.offset + q0, t.offset + q1)
        v_query = t.v[rows, own]
        neg_row_dot = -(grad_out_block * out[rows, q0:q1]).sum(-1, keepdim=True)  # -rowsum(W * dW), (bh, bq, 1)
        if t.euler:
            # dU_x . v_x is the part of G that the subtraction of rowsum(W_off) v_x takes back.
            grad_own = (grad_out_block * v_query).sum(-1, keepdim=True)  # (bh, bq, 1)
            neg_row_dot += grad_own
        # Accumulators of this query block, contiguous: in-place matmuls into strided views are slow.
        grad_q_block = t.q.new_zeros(bh, bq, t.q.shape[-1])
        ratio_values = t.v.new_zeros(bh, bq, dv)  # Y V
        ratio_rowsum = t.v.new_zeros(bh, bq, 1)
        for k0, k1 in t.key_blocks(b0, b1, q0, q1):
            attn = t.scores(rows, b0, b1, q0, q1, k0, k1, attn_buffer).sub_(lse[rows, q0:q1, None]).exp2_()  # A
            dist, coinciding = t.distances_eps(rows, q0, q1, k0, k1, dist_buffer)
            weights = t.plap_weights(attn, dist, q0, k0, out=_tile(weights_buffer, *attn.shape))
            keys, values = t.k[rows, k0:k1], t.v[rows, k0:k1]
            grad_v_keys = torch.bmm(weights.transpose(1, 2), grad_out_block)  # (bh, bk, dv)
            grad_w = torch.bmm(grad_out_block, values.transpose(1, 2), out=_tile(grad_w_buffer, *attn.shape))  # G
            if t.euler:
                grad_w.sub_(grad_own)
            product = grad_w.mul_(weights)  # T = W * dW
            grad_s = torch.addcmul(product, attn, neg_row_dot, out=attn)  # dS
            grad_q_block.baddbmm_(grad_s, keys)
            grad_k[rows, k0:k1] += torch.bmm(grad_s.transpose(1, 2), t.q[rows, q0:q1])
            ratio = product.div_(dist)  # Y = T / (D2 + eps); dL/dD2 = c Y
            t.self_diagonal(ratio, q0, k0).fill_(0)
            if coinciding is not None:
                ratio[coinciding] = 0
            # Y grows like 1 / (D2 + eps): these two products cancel against rowsum / colsum(Y) v, float32-exact.
            float32_baddbmm_(ratio_values, ratio, values)
            ratio_rowsum += ratio.sum(-1, keepdim=True)
            # dv_y += 2 c (colsum(Y) v_y - Y^T v_x)
            ratio_key_values = float32_baddbmm_(ratio.sum(1)[..., None] * values, ratio.transpose(1, 2), v_query,
                                                alpha=-1)  # (bh, bk, dv)
            grad_v_keys.addcmul_(ratio_key_values, neg_two_c[rows], value=-1)
            grad_v[rows, k0:k1] += grad_v_keys
        grad_q[rows, q0:q1] = grad_q_block
        # dv_x += 2 c (rowsum(Y) v_x - Y V)
        grad_v[rows, own] += ratio_values.sub_(ratio_rowsum * v_query).mul_(neg_two_c[rows])
    grad_q.mul_(t.scale)
    grad_k.mul_(t.scale)
    if t.euler:
        grad_v[:, t.offset :].addcmul_(grad_out, own_weight[..., None])
    return grad_q, grad_k, grad_v


# Forward and backward as custom ops, so that torch.compile and torch.export trace through the backend as one opaque
# node each way, whatever Python loops run inside (their fake versions give only the shapes); eager calls run the
# same two functions without the custom-op dispatcher (``FusedOp``).
def _fused_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    exponents: list[float],
    is_causal: bool,
    eps: float,
    euler: bool,
    blocks: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(query.device.type, enabled=False):
        tiling = _Tiling(query, key, value, exponents, bias, document_ids, is_causal, eps, euler, blocks)
        out, lse, own_weight = _forward(tiling)
    own_weight = lse.new_empty(0) if own_weight is None else own_weight
    return out.view(query.shape[:3] + value.shape[-1:]), lse, own_weight


_forward_op = torch.library.custom_op(op_name(__name__, "forward"), mutates_args=())(_fused_forward)


@_forward_op.register_fake
def _(query, key, value, bias, document_ids, exponents, is_causal, eps, euler, blocks):
    batch, heads, num_queries, _ = query.shape
    lse = query.new_empty(batch * heads, num_queries)
    return query.new_empty(query.shape[:3] + value.shape[-1:]), lse, lse.new_empty(lse.shape if euler else (0,))


def _fused_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    own_weight: torch.Tensor,
    exponents: list[float],
    is_causal: bool,
    eps: float,
    euler: bool,
    blocks: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(query.device.type, enabled=False):
        tiling = _Tiling(query, key, value, exponents, bias, document_ids, is_causal, eps, euler, blocks)
        out_rows, grad_rows = out.flatten(0, 1), grad_out.flatten(0, 1).to(out.dtype)  # (BH, Nq, dv)
        grads = _backward(tiling, out_rows, lse, own_weight if euler else None, grad_rows)
    return tuple(g.view(x.shape) for g, x in zip(grads, (query, key, value)))


_backward_op = torch.library.custom_op(op_name(__name__, "backward"), mutates_args=())(_fused_backward)


@_backward_op.register_fake
def _(grad_out, query, key, value, bias, document_ids, out, lse, own_weight, exponents, is_causal, eps, euler, blocks):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


_fused = FusedOp(_forward_op, _fused_forward, _backward_op, _fused_backward)


def plap_attention_tiled(
    query, key, value, *, p, attn_mask=None, is_causal=False, document_ids=None, eps=1e-6, formulation="paper",
    blocks=None,
):  # fmt: skip
    """p-Laplacian attention with O(N) extra memory; arguments as ``plap_attention`` (checked there).

    ``p`` is a sequence of floats, one per head (no gradient). ``blocks`` = (batch, query, key) block sizes
    overrides the automatic choice (tests use small blocks to exercise the online softmax).
    """
    euler = formulation_of(formulation, FORMULATIONS, "tiled").self_pair == "euler"
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    exponents = [(float(v) - 2) / 2 for v in p]
    bias = None
    if attn_mask is not None:
        mask = attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))  # (B|1, H|1, Nq|1, Nk|1)
        bias = torch.zeros(mask.shape, dtype=compute_dtype, device=query.device).masked_fill_(~mask, -math.inf)
    # P and every accumulation run in float32 (float64 for float64 inputs), also under autocast.
    with torch.autocast(query.device.type, enabled=False):
        out, _, _ = _fused(
            query.to(compute_dtype).contiguous(),
            key.to(compute_dtype).contiguous(),
            value.to(compute_dtype).contiguous(),
            bias,
            document_ids,
            exponents,
            is_causal,
            float(eps),
            euler,
            None if blocks is None else list(blocks),
        )
    return out.to(query.dtype)
