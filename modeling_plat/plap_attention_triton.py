"""Fused p-Laplacian attention in Triton: FlashAttention-2-style forward and backward kernels.

Same maths and backward as ``plap_attention_tiled`` (see its docstring), with each tile in registers:

- ``_plap_fwd_kernel``: one program per (query block, batch * head); loops over key blocks with an
  online softmax (running max and sum in float32); the numerator accumulates exp(s - m) * P @ V, the
  denominator exp(s - m) alone. Saves the output, the row logsumexp and, for euler, 1 - rowsum(W_off).
- ``_plap_bwd_dkdv_kernel``: one program per key block; loops over query blocks for dk and the
  key-side part of dv.
- ``_plap_bwd_dq_kernel``: one program per query block; loops over key blocks for dq and adds the
  query-side part of dv (the distance terms of each query's own value) to the rows dkdv wrote.

P and every accumulation are float32; the matmuls take the input dtype (float32 in IEEE precision, so
that float32 results match the reference to ~1e-6). Masks: causal (bottom-right aligned) and key
padding (a boolean mask broadcastable to (B, 1, 1, Nk)); ``plap_attention`` routes other masks to the
tiled backend. Lengths need not be multiples of the blocks. No gradient for p (a fixed buffer).

``import triton`` sits in try/except so that this module imports without Triton (remote code scans the
imports); ``triton_unsupported_reason`` then says why the backend cannot run. On CPU the kernels run under
the Triton interpreter when TRITON_INTERPRET=1 is set before this module is imported (tests do that).
"""

import math

import torch

try:
    import triton
    import triton.language as tl

    jit = triton.jit
    constexpr = tl.constexpr
    # Read at import, as triton.jit reads it when decorating the kernels below.
    INTERPRETED = triton.knobs.runtime.interpret
except ImportError:  # the kernels are then never launched: triton_unsupported_reason explains
    triton = tl = constexpr = None
    INTERPRETED = False

    def jit(fn):
        return fn


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
# Row max start: finite, so that rows with no allowed key so far give exp(-inf - MIN) = 0, never NaN.
MIN_SCORE = -1.0e38
# Tile sizes (query rows, key columns) on GPU; tests pass smaller ones to cross tile borders.
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2


def triton_unsupported_reason(query, attn_mask=None):
    """None when the Triton kernels can run this input, else why not (a phrase for an error message)."""
    if triton is None:
        return "triton is not installed (pip install triton)"
    if query.device.type != "cuda" and not (query.device.type == "cpu" and INTERPRETED):
        return (
            f"the kernels need CUDA tensors, got {query.device.type} (CPU tensors run only under the Triton "
            "interpreter, TRITON_INTERPRET=1 set before import)"
        )
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype} is not one of {SUPPORTED_DTYPES}"
    if query.shape[-1] > MAX_HEAD_DIM:
        return f"head size {query.shape[-1]} is above {MAX_HEAD_DIM}"
    if attn_mask is not None and _key_padding_shape(attn_mask) is None:
        return f"only key-padding masks broadcastable as (B, 1, 1, Nk) are fused; got {tuple(attn_mask.shape)}"
    return None


def _key_padding_shape(attn_mask):
    """(B or 1, Nk or 1) when attn_mask is a key-padding mask, else None."""
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)  # (B|1, H|1, Nq|1, Nk|1)
    return (shape[0], shape[3]) if shape[1] == 1 and shape[2] == 1 else None


@jit
def _allowed(rows, cols, num_queries, num_keys, key_keep_row, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr):
    """(M, N) boolean: query rows may attend to key cols (in range, causal, not padding)."""
    allowed = (rows[:, None] < num_queries) & (cols[None, :] < num_keys)
    if IS_CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None] + (num_keys - num_queries))
    if HAS_KEY_MASK:
        keep = tl.load(key_keep_row + cols, mask=cols < num_keys, other=0)
        allowed = allowed & (keep[None, :] != 0)
    return allowed


@jit
def _plap_weight(v_query, sq_query, values, sq_keys, rows, cols, offset, exponent, eps, DOT_PRECISION: constexpr):
    """D2 + eps (self pairs exactly eps), P = (D2 + eps) ** exponent, and the self-pair mask, all (M, N)."""
    cross = tl.dot(v_query, tl.trans(values), input_precision=DOT_PRECISION)
    dist = tl.maximum(sq_query[:, None] + sq_keys[None, :] - 2 * cross, 0.0)
    is_self = cols[None, :] == rows[:, None] + offset
    dist_eps = tl.where(is_self, 0.0, dist) + eps
    return dist_eps, tl.exp2(exponent * tl.log2(dist_eps)), is_self


@jit
def _plap_fwd_kernel(
    Q, K, V, Out, Lse, OwnWeight, Exponent, KeyKeep,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_keep_b,
    num_heads, num_queries, num_keys, scale, eps,
    HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
    BLOCK_M: constexpr, BLOCK_N: constexpr,
    IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, EULER: constexpr, DOT_PRECISION: constexpr,
):  # fmt: skip
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    offset = num_keys - num_queries  # query i is the token at key position offset + i
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    Q += batch * stride_qb + head * stride_qh
    K += batch * stride_kb + head * stride_kh
    V += batch * stride_vb + head * stride_vh
    key_keep_row = KeyKeep + batch * stride_keep_b
    row_in = rows < num_queries
    q = tl.load(Q + rows[:, None] * stride_qn + dims[None, :] * stride_qd,
                mask=row_in[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    v_query = tl.load(V + (rows + offset)[:, None] * stride_vn + vdims[None, :] * stride_vd,
                      mask=row_in[:, None] & (vdims[None, :] < VALUE_DIM), other=0.0)  # fmt: skip
    sq_query = tl.sum(v_query.to(tl.float32) * v_query.to(tl.float32), 1)
    exponent = tl.load(Exponent + head)

    row_max = tl.full([BLOCK_M], MIN_SCORE, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    off_sum = tl.zeros([BLOCK_M], tl.float32)  # rowsum(W_off) * running normaliser, euler only
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    end = num_keys
    if IS_CAUSAL:
        end = tl.minimum(num_keys, offset + (pid_m + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_in = cols < num_keys
        k = tl.load(K + cols[:, None] * stride_kn + dims[None, :] * stride_kd,
                    mask=col_in[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
        values = tl.load(V + cols[:, None] * stride_vn + vdims[None, :] * stride_vd,
                         mask=col_in[:, None] & (vdims[None, :] < VALUE_DIM), other=0.0)  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        allowed = _allowed(rows, cols, num_queries, num_keys, key_keep_row, IS_CAUSAL, HAS_KEY_MASK)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        rescale = tl.exp(row_max - new_max)
        expo = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(expo, 1)
        sq_keys = tl.sum(values.to(tl.float32) * values.to(tl.float32), 1)
        dist_eps, plap, is_self = _plap_weight(
            v_query, sq_query, values, sq_keys, rows, cols, offset, exponent, eps, DOT_PRECISION
        )
        weights = expo * plap
        if EULER:
            weights = tl.where(is_self, 0.0, weights)
            off_sum = off_sum * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=DOT_PRECISION)
        row_max = new_max

    valid = row_sum > 0  # at least one allowed key; fully masked rows output zeros
    inv_sum = 1.0 / tl.where(valid, row_sum, 1.0)
    out = acc * inv_sum[:, None]
    stat_rows = pid_bh * num_queries + rows
    if EULER:
        own_weight = tl.where(valid, 1.0 - off_sum * inv_sum, 0.0)  # u_x = v_x (1 - rowsum W_off) + W_off V
        out += own_weight[:, None] * v_query.to(tl.float32)
        tl.store(OwnWeight + stat_rows, own_weight, mask=row_in)
    Out += batch * stride_ob + head * stride_oh
    tl.store(Out + rows[:, None] * stride_on + vdims[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_in[:, None] & (vdims[None, :] < VALUE_DIM))  # fmt: skip
    # +inf on fully masked rows makes the backward's exp(s - lse) exactly 0 there.
    lse = row_max + tl.log(tl.where(valid, row_sum, 1.0))
    tl.store(Lse + stat_rows, tl.where(valid, lse, float("inf")), mask=row_in)


@jit
def _tile_grads(
    q, k, v_query, values, sq_query, sq_keys, grad_out, lse, delta, own_dot, rows, cols, key_keep_row,
    num_queries, num_keys, scale, exponent, eps,
    IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, EULER: constexpr, DOT_PRECISION: constexpr,
):  # fmt: skip
    """Recompute one (M, N) tile: W (W_off for euler), dS and 2 dL/dD2 (0 on self pairs)."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    allowed = _allowed(rows, cols, num_queries, num_keys, key_keep_row, IS_CAUSAL, HAS_KEY_MASK)
    attn = tl.exp(tl.where(allowed, scores, float("-inf")) - lse[:, None])
    dist_eps, plap, is_self = _plap_weight(
        v_query, sq_query, values, sq_keys, rows, cols, num_keys - num_queries, exponent, eps, DOT_PRECISION
    )
    weights = attn * plap
    grad_w = tl.dot(grad_out, tl.trans(values), input_precision=DOT_PRECISION)  # G = dU V^T
    if EULER:
        weights = tl.where(is_self, 0.0, weights)
        grad_w -= own_dot[:, None]  # dW = G - dU.v_x
    weighted = weights * grad_w
    grad_scores = weighted - attn * delta[:, None]
    grad_dist = tl.where(is_self, 0.0, 2 * exponent * weighted / dist_eps)
    return weights, grad_scores, grad_dist


@jit
def _plap_bwd_dkdv_kernel(
    Q, K, V, GradOut, Lse, Delta, OwnDot, Exponent, KeyKeep, GradK, GradV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_keep_b,
    num_heads, num_queries, num_keys, scale, eps,
    HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
    BLOCK_M: constexpr, BLOCK_N: constexpr,
    IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, EULER: constexpr, DOT_PRECISION: constexpr,
):  # fmt: skip
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    offset = num_keys - num_queries
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    Q += batch * stride_qb + head * stride_qh
    K += batch * stride_kb + head * stride_kh
    V += batch * stride_vb + head * stride_vh
    GradOut += batch * stride_gb + head * stride_gh
    key_keep_row = KeyKeep + batch * stride_keep_b
    col_in = cols < num_keys
    k = tl.load(K + cols[:, None] * stride_kn + dims[None, :] * stride_kd,
                mask=col_in[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    values = tl.load(V + cols[:, None] * stride_vn + vdims[None, :] * stride_vd,
                     mask=col_in[:, None] & (vdims[None, :] < VALUE_DIM), other=0.0)  # fmt: skip
    sq_keys = tl.sum(values.to(tl.float32) * values.to(tl.float32), 1)
    exponent = tl.load(Exponent + head)

    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    start_m = 0
    if IS_CAUSAL:  # queries before key position pid_n * BLOCK_N - offset never see this block
        start_m = tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
    for start in range(start_m, num_queries, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_in = rows < num_queries
        q = tl.load(Q + rows[:, None] * stride_qn + dims[None, :] * stride_qd,
                    mask=row_in[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
        v_query = tl.load(V + (rows + offset)[:, None] * stride_vn + vdims[None, :] * stride_vd,
                          mask=row_in[:, None] & (vdims[None, :] < VALUE_DIM), other=0.0)  # fmt: skip
        grad_out = tl.load(GradOut + rows[:, None] * stride_gn + vdims[None, :] * stride_gd,
                           mask=row_in[:, None] & (vdims[None, :] < VALUE_DIM), other=0.0)  # fmt: skip
        stat_rows = pid_bh * num_queries + rows
        lse = tl.load(Lse + stat_rows, mask=row_in, other=float("inf"))
        delta = tl.load(Delta + stat_rows, mask=row_in, other=0.0)
        own_dot = tl.load(OwnDot + stat_rows, mask=row_in, other=0.0)
        sq_query = tl.sum(v_query.to(tl.float32) * v_query.to(tl.float32), 1)
        weights, grad_scores, grad_dist = _tile_grads(
            q, k, v_query, values, sq_query, sq_keys, grad_out, lse, delta, own_dot, rows, cols, key_keep_row,
            num_queries, num_keys, scale, exponent, eps, IS_CAUSAL, HAS_KEY_MASK, EULER, DOT_PRECISION,
        )  # fmt: skip
        grad_v += tl.dot(tl.trans(weights).to(grad_out.dtype), grad_out, input_precision=DOT_PRECISION)
        grad_k += tl.dot(tl.trans(grad_scores).to(q.dtype), q, input_precision=DOT_PRECISION)
        # Key side of the distances: dv_y += 2 sum_x dL/dD2 (v_y - v_x).
        grad_v += tl.sum(grad_dist, 0)[:, None] * values.to(tl.float32)
        grad_v -= tl.dot(tl.trans(grad_dist), v_query.to(tl.float32), input_precision=DOT_PRECISION)

    out_mask = col_in[:, None] & (dims[None, :] < HEAD_DIM)
    grad_k_ptrs = GradK + pid_bh * num_keys * HEAD_DIM + cols[:, None] * HEAD_DIM + dims[None, :]
    tl.store(grad_k_ptrs, grad_k * scale, mask=out_mask)
    grad_v_ptrs = GradV + pid_bh * num_keys * VALUE_DIM + cols[:, None] * VALUE_DIM + vdims[None, :]
    tl.store(grad_v_ptrs, grad_v, mask=col_in[:, None] & (vdims[None, :] < VALUE_DIM))


@jit
def _plap_bwd_dq_kernel(
    Q, K, V, GradOut, Lse, Delta, OwnDot, OwnWeight, Exponent, KeyKeep, GradQ, GradV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_keep_b,
    num_heads, num_queries, num_keys, scale, eps,
    HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
    BLOCK_M: constexpr, BLOCK_N: constexpr,
    IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, EULER: constexpr, DOT_PRECISION: constexpr,
):  # fmt: skip
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    offset = num_keys - num_queries
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    Q += batch * stride_qb + head * stride_qh
    K += batch * stride_kb + head * stride_kh
    V += batch * stride_vb + head * stride_vh
    GradOut += batch * stride_gb + head * stride_gh
    key_keep_row = KeyKeep + batch * stride_keep_b
    row_in = rows < num_queries
    vmask = row_in[:, None] & (vdims[None, :] < VALUE_DIM)
    q = tl.load(Q + rows[:, None] * stride_qn + dims[None, :] * stride_qd,
                mask=row_in[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    v_query = tl.load(V + (rows + offset)[:, None] * stride_vn + vdims[None, :] * stride_vd, mask=vmask, other=0.0)
    grad_out = tl.load(GradOut + rows[:, None] * stride_gn + vdims[None, :] * stride_gd, mask=vmask, other=0.0)
    stat_rows = pid_bh * num_queries + rows
    lse = tl.load(Lse + stat_rows, mask=row_in, other=float("inf"))
    delta = tl.load(Delta + stat_rows, mask=row_in, other=0.0)
    own_dot = tl.load(OwnDot + stat_rows, mask=row_in, other=0.0)
    sq_query = tl.sum(v_query.to(tl.float32) * v_query.to(tl.float32), 1)
    exponent = tl.load(Exponent + head)

    grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    grad_v_own = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # query side of the distances
    grad_dist_rowsum = tl.zeros([BLOCK_M], tl.float32)
    end = num_keys
    if IS_CAUSAL:
        end = tl.minimum(num_keys, offset + (pid_m + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_in = cols < num_keys
        k = tl.load(K + cols[:, None] * stride_kn + dims[None, :] * stride_kd,
                    mask=col_in[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
        values = tl.load(V + cols[:, None] * stride_vn + vdims[None, :] * stride_vd,
                         mask=col_in[:, None] & (vdims[None, :] < VALUE_DIM), other=0.0)  # fmt: skip
        sq_keys = tl.sum(values.to(tl.float32) * values.to(tl.float32), 1)
        weights, grad_scores, grad_dist = _tile_grads(
            q, k, v_query, values, sq_query, sq_keys, grad_out, lse, delta, own_dot, rows, cols, key_keep_row,
            num_queries, num_keys, scale, exponent, eps, IS_CAUSAL, HAS_KEY_MASK, EULER, DOT_PRECISION,
        )  # fmt: skip
        grad_q += tl.dot(grad_scores.to(k.dtype), k, input_precision=DOT_PRECISION)
        grad_v_own -= tl.dot(grad_dist, values.to(tl.float32), input_precision=DOT_PRECISION)
        grad_dist_rowsum += tl.sum(grad_dist, 1)

    grad_q_ptrs = GradQ + pid_bh * num_queries * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    tl.store(grad_q_ptrs, grad_q * scale, mask=row_in[:, None] & (dims[None, :] < HEAD_DIM))
    # dv_x += 2 sum_y dL/dD2 (v_x - v_y), plus for euler the direct dU_x (1 - rowsum W_off).
    grad_v_own += grad_dist_rowsum[:, None] * v_query.to(tl.float32)
    if EULER:
        own_weight = tl.load(OwnWeight + stat_rows, mask=row_in, other=0.0)
        grad_v_own += own_weight[:, None] * grad_out.to(tl.float32)
    # The dkdv kernel, launched before, wrote these rows; each program here owns its own rows.
    grad_v_ptrs = GradV + pid_bh * num_keys * VALUE_DIM + (rows + offset)[:, None] * VALUE_DIM + vdims[None, :]
    tl.store(grad_v_ptrs, tl.load(grad_v_ptrs, mask=vmask, other=0.0) + grad_v_own, mask=vmask)


def _strides(tensor):
    return tuple(tensor.stride())


def _meta(query, value, blocks, is_causal, has_key_mask, euler):
    block_m, block_n = blocks
    return dict(
        HEAD_DIM=query.shape[-1],
        VALUE_DIM=value.shape[-1],
        BLOCK_D=max(16, triton.next_power_of_2(query.shape[-1])),
        BLOCK_DV=max(16, triton.next_power_of_2(value.shape[-1])),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IS_CAUSAL=is_causal,
        HAS_KEY_MASK=has_key_mask,
        EULER=euler,
        # Precision of float32 matmuls: IEEE for float32 inputs (TF32 would cost their ~1e-6 agreement with
        # the reference); TF32 for half inputs, whose float32 dots are only the distance gradients, kept
        # out of half types because 1 / (D2 + eps) overflows float16 for near-duplicate values.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


class _PlapAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, exponent, key_keep, is_causal, eps, euler, blocks):
        batch, heads, num_queries, _ = query.shape
        num_keys = key.shape[2]
        has_key_mask = key_keep is not None
        key_keep = key_keep if has_key_mask else exponent  # any pointer; never read without the mask
        out = query.new_empty(batch, heads, num_queries, value.shape[-1])  # (B, H, Nq, dv)
        lse = torch.empty(batch, heads, num_queries, device=query.device, dtype=torch.float32)
        own_weight = torch.empty_like(lse) if euler else lse  # written by euler only
        meta = _meta(query, value, blocks, is_causal, has_key_mask, euler)
        grid = (triton.cdiv(num_queries, blocks[0]), batch * heads)
        _plap_fwd_kernel[grid](
            query, key, value, out, lse, own_weight, exponent, key_keep,
            *_strides(query), *_strides(key), *_strides(value), *_strides(out), key_keep.stride(0),
            heads, num_queries, num_keys, 1 / math.sqrt(query.shape[-1]), eps, **meta,
        )  # fmt: skip
        ctx.save_for_backward(query, key, value, out, lse, own_weight, exponent, key_keep)
        ctx.args = (is_causal, eps, euler, blocks, has_key_mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, own_weight, exponent, key_keep = ctx.saved_tensors
        is_causal, eps, euler, blocks, has_key_mask = ctx.args
        batch, heads, num_queries, _ = query.shape
        num_keys = key.shape[2]
        grad_f32 = grad_out.float()
        # FlashAttention's D = rowsum(dU * U); euler subtracts the own-value part dU . v_x.
        own_dot = (grad_f32 * value[:, :, num_keys - num_queries :].float()).sum(-1)  # (B, H, Nq)
        delta = (grad_f32 * out.float()).sum(-1) - (own_dot if euler else 0)
        grad_q = torch.empty(query.shape, device=query.device, dtype=torch.float32)
        grad_k = torch.empty(key.shape, device=query.device, dtype=torch.float32)
        grad_v = torch.empty(value.shape, device=query.device, dtype=torch.float32)
        meta = _meta(query, value, blocks, is_causal, has_key_mask, euler)
        common = (
            *_strides(query), *_strides(key), *_strides(value), *_strides(grad_out), key_keep.stride(0),
            heads, num_queries, num_keys, 1 / math.sqrt(query.shape[-1]), eps,
        )  # fmt: skip
        _plap_bwd_dkdv_kernel[(triton.cdiv(num_keys, blocks[1]), batch * heads)](
            query, key, value, grad_out, lse, delta, own_dot, exponent, key_keep, grad_k, grad_v, *common, **meta
        )
        _plap_bwd_dq_kernel[(triton.cdiv(num_queries, blocks[0]), batch * heads)](
            query, key, value, grad_out, lse, delta, own_dot, own_weight, exponent, key_keep, grad_q, grad_v,
            *common, **meta,
        )  # fmt: skip
        grads = (grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype))
        return *grads, None, None, None, None, None, None


def plap_attention_triton(
    query, key, value, p, attn_mask=None, is_causal=False, eps=1e-6, formulation="paper", blocks=None
):
    """p-Laplacian attention with fused kernels; arguments as ``plap_attention`` (inputs checked there).

    ``p`` is an (H,) tensor and gets no gradient. ``attn_mask`` must be a key-padding mask (see
    ``triton_unsupported_reason``). ``blocks`` = (BLOCK_M, BLOCK_N) overrides the tile sizes.
    """
    reason = triton_unsupported_reason(query, attn_mask)
    if reason is not None:
        raise ValueError(f"the Triton backend cannot run this input: {reason}")
    if p.requires_grad and torch.is_grad_enabled():
        raise ValueError("the Triton backend computes no gradient for p; use backend='eager' to train p")
    key_keep = None
    if attn_mask is not None:
        batch, num_keys = query.shape[0], key.shape[2]
        key_keep = attn_mask.reshape(_key_padding_shape(attn_mask)).expand(batch, num_keys)
        key_keep = key_keep.to(torch.int8).contiguous()  # (B, Nk)
    exponent = ((p.detach().float() - 2) / 2).contiguous()  # (H,)
    return _PlapAttentionTriton.apply(
        query, key, value, exponent, key_keep, is_causal, eps, formulation == "euler", blocks or (BLOCK_M, BLOCK_N)
    )
