"""The fused backward kernels of p-Laplacian attention: dQ (with the query side of dV), then dK/dV.

Both recompute each tile's weights from the forward's logsumexp (``_tile_grads``): W = A * P, dS = W * dW - A * D with
FlashAttention's D = rowsum(dU * U), and the distance gradient -2 dL/dD2, which reaches dV through
dv_x += 2 sum_y dL/dD2 (v_x - v_y) on the query side and the same with y and x swapped on the key side.

- ``plap_dq_kernel``: one program per (query block, batch * head), launched first; stores its queries' D for the
  dK/dV kernel, loops over key tiles for dQ and the query-side part of dV (float32, ``GradVOwn``).
- ``plap_dkdv_kernel``: one program per (key block, batch * head); loops over query tiles for dK and the key-side part
  of dV, adds the query side and stores dV once in the values' dtype.

Each runs a first pass and an exact pass over its grid (``PASS``), split by the forward's flags: a dQ block takes the
exact pass where the forward flagged one of its query blocks holding any of its queries, a dK/dV block where the
forward's exact pass flagged a key tile holding any of its keys; each pass leaves the other's blocks at once. An exact
pass on smaller blocks than its first pass's (``KernelConfig.exact_block``) decides by the first-pass block that holds
its own. Small calls run the exact pass alone over every block.
"""

from __future__ import annotations

from .triton_tiles import (
    EXACT_ALONE, EXACT_PASS, FIRST_PASS, FLOAT32_DOT, LN_2, any_set, class_exponent, close_bounds, distances,
    exact_dot, fixed_documents, float32_scalars, forward_flagged, jit, key_loop_bounds, load_rows, load_vector,
    masked_scores, pair_dot, pass_block_start, per_query, power, program_ids, query_loop_bounds, row_ptrs, row_sums,
    row_sums_init, rows_from, runs_head, slab_rows, squared_norms, store_rows, tile_start, times_minus_two, tl,
)  # fmt: skip


@jit
def _tile_grads(q, k, query_side, key_side, bounds, grad_out, row_stats, V, rows, cols, sizes, masks, head,
                VALUE_DIM: tl.constexpr, POWER: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, EULER: tl.constexpr,
                QUERY_AXIS: tl.constexpr, EXACT: tl.constexpr, HEAD_DIM: tl.constexpr,
                CHUNK: tl.constexpr):  # fmt: skip
    """Recompute one tile (``query_side`` and ``key_side`` as ``distances`` takes them): W (W_off for euler), dS and
    -2 dL/dD2 (0 where D2 + eps is eps: self and coinciding pairs, whose exact gradient through D2 is 0 and whose
    computed one would be rounding), and whether it has close pairs (without EXACT their distances stay expanded: the
    caller discards such tiles). The sign joins the constant 2 (p - 2) / 2, so that the distance matmuls take it
    without a negation per score. ``row_stats`` are the queries' (lse, D, euler's dU . v_x). With CHUNK, ``q``,
    ``k`` and ``grad_out`` are rows in memory, and the products over the head sizes load both sides CHUNK columns at
    a time (``pair_dot``)."""
    num_queries, num_keys = sizes
    scale_log2, exponent, eps = head
    lse, delta, own_dot = row_stats
    # s - lse in one FMA (+inf lse of fully masked rows: -inf, as masked pairs)
    shifted = tl.fma(pair_dot(q, k, QUERY_AXIS, None, CHUNK, HEAD_DIM), scale_log2, -per_query(lse, QUERY_AXIS))
    attn = tl.exp2(masked_scores(shifted, rows, cols, sizes, masks, MASKED=MASKED, IS_CAUSAL=IS_CAUSAL,
                                 HAS_WINDOW=HAS_WINDOW, HAS_KEY_MASK=HAS_KEY_MASK, HAS_DOCUMENTS=HAS_DOCUMENTS,
                                 QUERY_AXIS=QUERY_AXIS))  # [BF, BL]  # fmt: skip
    dist_eps, is_self, has_close = distances(query_side, key_side, bounds, V, rows, cols, num_keys,
                                             num_keys - num_queries, eps, VALUE_DIM=VALUE_DIM, MASKED=MASKED,
                                             QUERY_AXIS=QUERY_AXIS, EXACT=EXACT, CHUNK=CHUNK)  # fmt: skip
    exponent = class_exponent(exponent, POWER)
    weight_power, inv_dist = power(dist_eps, exponent, POWER)
    weights = attn * weight_power
    if CHUNK:
        grad_w = pair_dot(grad_out, (V, cols, num_keys), QUERY_AXIS, None, CHUNK, VALUE_DIM)  # G = dU V^T
    else:
        grad_w = pair_dot(grad_out, key_side[0], QUERY_AXIS)
    if EULER:
        if MASKED:
            weights = tl.where(is_self, 0.0, weights)
        grad_w -= per_query(own_dot, QUERY_AXIS)  # dW = G - dU.v_x
    weighted = weights * grad_w
    grad_scores = tl.fma(-attn, per_query(delta, QUERY_AXIS), weighted)
    grad_dist = (-2 * exponent) * weighted * inv_dist
    if MASKED:  # self pairs
        grad_dist = tl.where(dist_eps == eps, 0.0, grad_dist)
    elif EXACT:
        if any_set(has_close):
            grad_dist = tl.where(dist_eps == eps, 0.0, grad_dist)
    return weights, grad_scores, grad_dist


@jit
def _query_side(slab, rows, V, Norms, GradOut, Lse, Delta, OwnDot, num_queries, num_keys, VALUE_DIM: tl.constexpr,
                BLOCK_DV: tl.constexpr, LOAD_STATS: tl.constexpr, CHECK_ROWS: tl.constexpr):  # fmt: skip
    """What a backward tile needs of a block of queries besides q: own values [BM, BDV], their norms (not squared:
    ``distances`` squares a loop tile's), dU [BM, BDV], the logsumexp, and (``LOAD_STATS``) the row statistics [BM].
    ``V`` and ``GradOut`` are the slab's rows (``slab_rows``)."""
    offset = num_keys - num_queries
    stats = slab * num_queries
    v_query = load_rows(rows_from(V, offset), rows, num_queries, VALUE_DIM, BLOCK_DV, CHECK_ROWS)
    query_norms = load_vector(Norms + offset, rows, num_queries, 0.0, CHECK_ROWS)
    grad_out = load_rows(GradOut, rows, num_queries, VALUE_DIM, BLOCK_DV, CHECK_ROWS)
    lse = load_vector(Lse + stats, rows, num_queries, float("inf"), CHECK_ROWS)
    delta = lse  # not read: the dq kernel computes its own (``_row_stats``)
    own_dot = lse
    if LOAD_STATS:
        delta = load_vector(Delta + stats, rows, num_queries, 0.0, CHECK_ROWS)
        own_dot = load_vector(OwnDot + stats, rows, num_queries, 0.0, CHECK_ROWS)
    return v_query, query_norms, grad_out, lse, delta, own_dot


@jit
def _row_stats(Out, Delta, OwnDot, slab, rows, grad_out, v_query, num_queries, VALUE_DIM: tl.constexpr,
               EULER: tl.constexpr):  # fmt: skip
    """FlashAttention's D = rowsum(dU * U) of the dq kernel's own queries, in float32 from the stored operands;
    euler subtracts the own-value part dU . v_x (its ``own_dot``), which the paper formulation never reads. Stored
    for the dkdv kernel, launched after, whose loops read every query's: by the pass that runs the block."""
    grad_out = grad_out.to(tl.float32)
    out = load_rows(Out, rows, num_queries, VALUE_DIM, grad_out.shape[1])
    delta = tl.sum(grad_out * out.to(tl.float32), 1)  # [BM]
    own_dot = delta
    if EULER:
        own_dot = tl.sum(grad_out * v_query.to(tl.float32), 1)
        delta -= own_dot
    row_in = rows < num_queries
    tl.store(Delta + slab * num_queries + rows, delta, mask=row_in)
    if EULER:
        tl.store(OwnDot + slab * num_queries + rows, own_dot, mask=row_in)
    return delta, own_dot


# ------------------------------------------------------------------------------------------------ dK and dV


@jit
def _dkdv_tile(grad_k, grad_v, grad_dist_sum, keys, queries, head, sizes, start, HEAD_DIM: tl.constexpr,
               VALUE_DIM: tl.constexpr, BLOCK_M: tl.constexpr, POWER: tl.constexpr, MASKED: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
               HAS_DOCUMENTS: tl.constexpr, EULER: tl.constexpr, EXACT: tl.constexpr,
               SUMS_BY_MATMUL: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """dK, dV and the distance gradient's row sums after the query tile at ``start``; (keys, queries) tiles. With
    CHUNK, ``k`` is the block's rows in memory (``pair_dot``)."""
    cols, k, values, sq_keys_eps, bounds = keys
    slab, Q, V, Norms, GradOut, Lse, Delta, OwnDot, masks = queries
    num_queries, num_keys = sizes
    rows = start + tl.arange(0, BLOCK_M)  # [BM]
    q = load_rows(Q, rows, num_queries, HEAD_DIM, grad_k.shape[1], MASKED)  # [BM, BD]
    v_query, query_norms, grad_out, lse, delta, own_dot = _query_side(
        slab, rows, V, Norms, GradOut, Lse, Delta, OwnDot, num_queries, num_keys, VALUE_DIM=VALUE_DIM,
        BLOCK_DV=grad_v.shape[1], LOAD_STATS=True, CHECK_ROWS=MASKED,
    )  # fmt: skip
    if CHUNK:
        tile_q = (Q, rows, num_queries)
        tile_grad_out = (GradOut, rows, num_queries)
    else:
        tile_q, tile_grad_out = q, grad_out
    weights, grad_scores, grad_dist = _tile_grads(
        tile_q, k, (v_query, query_norms), (values, sq_keys_eps), bounds, tile_grad_out, (lse, delta, own_dot), V,
        rows, cols, sizes, masks, head, VALUE_DIM=VALUE_DIM, POWER=POWER, MASKED=MASKED, IS_CAUSAL=IS_CAUSAL,
        HAS_WINDOW=HAS_WINDOW, HAS_KEY_MASK=HAS_KEY_MASK, HAS_DOCUMENTS=HAS_DOCUMENTS, EULER=EULER, QUERY_AXIS=1,
        EXACT=EXACT, HEAD_DIM=HEAD_DIM, CHUNK=CHUNK,
    )  # [BN, BM] each  # fmt: skip
    grad_v += tl.dot(weights.to(grad_out.dtype), grad_out, input_precision=FLOAT32_DOT)
    grad_k += tl.dot(grad_scores.to(q.dtype), q, input_precision=FLOAT32_DOT)
    # Key side of the distances: dv_y += 2 sum_x dL/dD2 (v_y - v_x) (grad_dist is -2 dL/dD2); the v_y term after the
    # loop.
    grad_v, grad_dist_sum = exact_dot(grad_dist, v_query, grad_v, grad_dist_sum, EXACT, SUMS_BY_MATMUL)
    return grad_k, grad_v, grad_dist_sum


@jit(do_not_specialize=["high_heads", "stats_plane"])  # as plap_forward_kernel's
def plap_dkdv_kernel(
    Q, K, V, Norms, KeyKeep, Documents, GradOut, Lse, Delta, OwnDot, GradVOwn, GradK, GradV, KeyTiles,
    head_start, run_heads, num_heads, num_queries, num_keys, window, scale_log2, exponent_low, exponent_high,
    high_heads, eps, stats_plane,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POWER: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, EULER: tl.constexpr,
    PASS: tl.constexpr, FLAG_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, SUMS_BY_MATMUL: tl.constexpr,
    HEAD_CHUNK: tl.constexpr,
    Q_ROW_STRIDE: tl.constexpr, K_ROW_STRIDE: tl.constexpr, V_ROW_STRIDE: tl.constexpr, OUT_ROW_STRIDE: tl.constexpr,
):  # fmt: skip
    """A key block goes to the exact pass where the forward's exact pass flagged a key tile (FLAG_BLOCK keys) that
    holds any of the keys of its first-pass block (PASS_BLOCK keys: the block itself, or the one that holds an exact
    pass's smaller block), and to the first pass otherwise. HEAD_CHUNK as in ``plap_forward_kernel``: the block's keys
    and values stay in memory."""
    scale_log2, exponent_low, exponent_high, eps = float32_scalars(scale_log2, exponent_low, exponent_high, eps)
    pid_n, slab, exponent = program_ids(num_keys, head_start, run_heads, num_heads, high_heads, exponent_low,
                                        exponent_high, BLOCK_N, False)  # fmt: skip
    if not runs_head(exponent, POWER):
        return
    KeyTiles += slab * tl.cdiv(num_keys, FLAG_BLOCK)
    if PASS != EXACT_ALONE:
        first = pass_block_start(pid_n, BLOCK_N, PASS_BLOCK)
        if forward_flagged(KeyTiles, first, num_keys, PASS_BLOCK, FLAG_BLOCK) != (PASS == EXACT_PASS):
            return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    key_strides = (stride_kb, stride_kh, K_ROW_STRIDE)
    value_strides = (stride_vb, stride_vh, V_ROW_STRIDE)
    K = slab_rows(K, slab, num_heads, key_strides)
    V = slab_rows(V, slab, num_heads, value_strides)
    Norms += slab * num_keys
    key_keep_row = KeyKeep + (slab // num_heads) * num_keys
    if HEAD_CHUNK:
        k = (K, cols, num_keys)
        values = 0.0  # distances and G read them from V; loaded after the loop
    else:
        k = load_rows(K, cols, num_keys, HEAD_DIM, BLOCK_D)  # [BN, BD]
        values = load_rows(V, cols, num_keys, VALUE_DIM, BLOCK_DV)  # [BN, BDV]
    sq_keys_eps = squared_norms(Norms, cols, num_keys) + eps  # [BN]
    docs, span = fixed_documents(Documents if HAS_DOCUMENTS else None, slab, num_heads, cols, num_keys,
                                 HAS_DOCUMENTS)
    keys = (cols, k, values, sq_keys_eps, close_bounds(sq_keys_eps, eps, 1))
    Q = slab_rows(Q, slab, num_heads, (stride_qb, stride_qh, Q_ROW_STRIDE))
    # dU takes the output's layout (plap_attention_triton.in_layout_of)
    GradOut = slab_rows(GradOut, slab, num_heads, (stride_ob, stride_oh, OUT_ROW_STRIDE))
    queries = (slab, Q, V, Norms, GradOut, Lse, Delta, OwnDot, (key_keep_row, docs, window))
    sizes = (num_queries, num_keys)
    plain, masked = query_loop_bounds(pid_n, num_queries, num_keys, window, span, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                      HAS_WINDOW, HAS_KEY_MASK)  # fmt: skip
    head = (scale_log2, exponent, eps)
    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)  # [BN, BD]
    grad_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)  # [BN, BDV], without its v_y term until after the loop
    grad_dist_sum = row_sums_init(BLOCK_N, V[0].dtype.element_ty, SUMS_BY_MATMUL)
    for phase in tl.static_range(2):  # the plain tiles (all pairs allowed, off the diagonal), then the masked ones
        tiles = plain if phase == 0 else masked
        for index in range(0, tiles[0]):
            grad_k, grad_v, grad_dist_sum = _dkdv_tile(
                grad_k, grad_v, grad_dist_sum, keys, queries, head, sizes, tile_start(index, tiles, BLOCK_M),
                HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, BLOCK_M=BLOCK_M, POWER=POWER, MASKED=phase == 1,
                IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_KEY_MASK=HAS_KEY_MASK, HAS_DOCUMENTS=HAS_DOCUMENTS,
                EULER=EULER, EXACT=PASS != FIRST_PASS, SUMS_BY_MATMUL=SUMS_BY_MATMUL, CHUNK=HEAD_CHUNK,
            )  # fmt: skip

    if HEAD_CHUNK:
        values = load_rows(V, cols, num_keys, VALUE_DIM, BLOCK_DV)  # [BN, BDV]
    grad_v -= row_sums(grad_dist_sum)[:, None] * values.to(tl.float32)
    # The dq kernel, launched before, left each query's own-value part in float32 (the keys at or after the offset
    # are queries' values); dv is stored once, in the values' dtype.
    offset = num_keys - num_queries
    own_ptrs, col_in = row_ptrs((GradVOwn + slab * num_queries * VALUE_DIM, VALUE_DIM), cols - offset, VALUE_DIM,
                                BLOCK_DV)  # fmt: skip
    grad_v += tl.load(own_ptrs, mask=((cols >= offset) & (cols < num_keys))[:, None] & col_in, other=0.0)
    # dK and dV take the layouts of K and V (plap_attention_triton.kernel_layout)
    store_rows(slab_rows(GradK, slab, num_heads, key_strides), cols, num_keys, grad_k * (scale_log2 * LN_2), HEAD_DIM)
    store_rows(slab_rows(GradV, slab, num_heads, value_strides), cols, num_keys, grad_v, VALUE_DIM)


# ------------------------------------------------------------------------------------------------ dQ


@jit
def _dq_tile(grad_q, grad_v_own, grad_dist_sum, queries, keys, head, sizes, start, HEAD_DIM: tl.constexpr,
             VALUE_DIM: tl.constexpr, BLOCK_N: tl.constexpr, POWER: tl.constexpr, MASKED: tl.constexpr,
             IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
             EULER: tl.constexpr, EXACT: tl.constexpr, SUMS_BY_MATMUL: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """dQ, the query side of dV and the distance gradient's row sums after the key tile at ``start``. With CHUNK,
    ``q`` and ``grad_out`` are the block's rows in memory (``pair_dot``)."""
    rows, q, v_query_m2, sq_query_eps, bounds, grad_out, row_stats = queries
    K, V, Norms, masks = keys
    num_keys = sizes[1]
    cols = start + tl.arange(0, BLOCK_N)  # [BN]
    k = load_rows(K, cols, num_keys, HEAD_DIM, grad_q.shape[1], MASKED)  # [BN, BD]
    values = load_rows(V, cols, num_keys, VALUE_DIM, grad_v_own.shape[1], MASKED)  # [BN, BDV]
    key_norms = load_vector(Norms, cols, num_keys, 0.0, MASKED)  # [BN]
    weights, grad_scores, grad_dist = _tile_grads(
        q, (K, cols, num_keys) if CHUNK else k, (v_query_m2, sq_query_eps), (values, key_norms), bounds, grad_out,
        row_stats, V, rows, cols, sizes, masks, head, VALUE_DIM=VALUE_DIM, POWER=POWER, MASKED=MASKED,
        IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_KEY_MASK=HAS_KEY_MASK, HAS_DOCUMENTS=HAS_DOCUMENTS, EULER=EULER,
        QUERY_AXIS=0, EXACT=EXACT, HEAD_DIM=HEAD_DIM, CHUNK=CHUNK,
    )  # [BM, BN] each  # fmt: skip
    grad_q += tl.dot(grad_scores.to(k.dtype), k, input_precision=FLOAT32_DOT)
    grad_v_own, grad_dist_sum = exact_dot(grad_dist, values, grad_v_own, grad_dist_sum, EXACT, SUMS_BY_MATMUL)
    return grad_q, grad_v_own, grad_dist_sum


@jit(do_not_specialize=["high_heads", "stats_plane"])  # as plap_forward_kernel's
def plap_dq_kernel(
    Q, K, V, Norms, KeyKeep, Documents, GradOut, Lse, Delta, OwnDot, Out, GradQ, GradVOwn, QueryBlocks,
    head_start, run_heads, num_heads, num_queries, num_keys, window, scale_log2, exponent_low, exponent_high,
    high_heads, eps, stats_plane,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POWER: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, EULER: tl.constexpr,
    PASS: tl.constexpr, FLAG_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, SUMS_BY_MATMUL: tl.constexpr,
    HEAD_CHUNK: tl.constexpr,
    Q_ROW_STRIDE: tl.constexpr, K_ROW_STRIDE: tl.constexpr, V_ROW_STRIDE: tl.constexpr, OUT_ROW_STRIDE: tl.constexpr,
):  # fmt: skip
    """A query block goes to the exact pass where the forward flagged one of its query blocks (FLAG_BLOCK queries)
    that holds any of the queries of this block's first-pass block (PASS_BLOCK queries, as dK/dV's keys), and to the
    first pass otherwise. HEAD_CHUNK as in ``plap_forward_kernel``: the block's queries, values and dU stay in
    memory."""
    scale_log2, exponent_low, exponent_high, eps = float32_scalars(scale_log2, exponent_low, exponent_high, eps)
    pid_m, slab, exponent = program_ids(num_queries, head_start, run_heads, num_heads, high_heads, exponent_low,
                                        exponent_high, BLOCK_M, IS_CAUSAL)  # fmt: skip
    if not runs_head(exponent, POWER):
        return
    QueryBlocks += slab * tl.cdiv(num_queries, FLAG_BLOCK)
    if PASS != EXACT_ALONE:
        first = pass_block_start(pid_m, BLOCK_M, PASS_BLOCK)
        if forward_flagged(QueryBlocks, first, num_queries, PASS_BLOCK, FLAG_BLOCK) != (PASS == EXACT_PASS):
            return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    query_strides = (stride_qb, stride_qh, Q_ROW_STRIDE)
    Q = slab_rows(Q, slab, num_heads, query_strides)
    K = slab_rows(K, slab, num_heads, (stride_kb, stride_kh, K_ROW_STRIDE))
    V = slab_rows(V, slab, num_heads, (stride_vb, stride_vh, V_ROW_STRIDE))
    # dU takes the output's layout (plap_attention_triton.in_layout_of)
    GradOut = slab_rows(GradOut, slab, num_heads, (stride_ob, stride_oh, OUT_ROW_STRIDE))
    Norms += slab * num_keys
    key_keep_row = KeyKeep + (slab // num_heads) * num_keys
    if HEAD_CHUNK:  # the tiles read the block's rows from memory; v_query and grad_out are loaded again after the loop
        q = (Q, rows, num_queries)
    else:
        q = load_rows(Q, rows, num_queries, HEAD_DIM, BLOCK_D)  # [BM, BD]
    v_query, query_norms, grad_out, lse, _, _ = _query_side(
        slab, rows, V, Norms, GradOut, Lse, Delta, OwnDot, num_queries, num_keys, VALUE_DIM=VALUE_DIM,
        BLOCK_DV=BLOCK_DV, LOAD_STATS=False, CHECK_ROWS=True,
    )  # fmt: skip
    v_query_m2 = 0.0 if HEAD_CHUNK else times_minus_two(v_query)
    sq_query_eps = query_norms * query_norms + eps
    bounds = close_bounds(sq_query_eps, eps, 0)
    Out = slab_rows(Out, slab, num_heads, (stride_ob, stride_oh, OUT_ROW_STRIDE))
    delta, own_dot = _row_stats(Out, Delta, OwnDot, slab, rows, grad_out, v_query, num_queries, VALUE_DIM, EULER)
    docs, span = fixed_documents(Documents if HAS_DOCUMENTS else None, slab, num_heads, rows, num_keys,
                                 HAS_DOCUMENTS)
    tile_grad_out = (GradOut, rows, num_queries) if HEAD_CHUNK else grad_out
    queries = (rows, q, v_query_m2, sq_query_eps, bounds, tile_grad_out, (lse, delta, own_dot))
    keys = (K, V, Norms, (key_keep_row, docs, window))
    sizes = (num_queries, num_keys)
    plain, masked = key_loop_bounds(pid_m, num_queries, num_keys, window, span, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
                                    HAS_KEY_MASK)  # fmt: skip
    head = (scale_log2, exponent, eps)
    grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # [BM, BD]
    grad_v_own = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # [BM, BDV], the query side of the distances' dV
    grad_dist_sum = row_sums_init(BLOCK_M, V[0].dtype.element_ty, SUMS_BY_MATMUL)
    for phase in tl.static_range(2):  # the plain tiles (all pairs allowed, off the diagonal), then the masked ones
        tiles = plain if phase == 0 else masked
        for index in range(0, tiles[0]):
            grad_q, grad_v_own, grad_dist_sum = _dq_tile(
                grad_q, grad_v_own, grad_dist_sum, queries, keys, head, sizes, tile_start(index, tiles, BLOCK_N),
                HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, BLOCK_N=BLOCK_N, POWER=POWER, MASKED=phase == 1,
                IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_KEY_MASK=HAS_KEY_MASK, HAS_DOCUMENTS=HAS_DOCUMENTS,
                EULER=EULER, EXACT=PASS != FIRST_PASS, SUMS_BY_MATMUL=SUMS_BY_MATMUL, CHUNK=HEAD_CHUNK,
            )  # fmt: skip

    if HEAD_CHUNK:
        v_query, _, grad_out, _, _, _ = _query_side(
            slab, rows, V, Norms, GradOut, Lse, Delta, OwnDot, num_queries, num_keys, VALUE_DIM=VALUE_DIM,
            BLOCK_DV=BLOCK_DV, LOAD_STATS=False, CHECK_ROWS=True,
        )  # fmt: skip
    GradQ = slab_rows(GradQ, slab, num_heads, query_strides)  # dQ takes the queries' layout
    store_rows(GradQ, rows, num_queries, grad_q * (scale_log2 * LN_2), HEAD_DIM)
    # dv_x += 2 sum_y dL/dD2 (v_x - v_y), plus for euler the direct dU_x (1 - rowsum W_off).
    grad_v_own -= row_sums(grad_dist_sum)[:, None] * v_query.to(tl.float32)
    if EULER:
        own_weight = tl.load(Lse + stats_plane + slab * num_queries + rows, mask=rows < num_queries, other=0.0)
        grad_v_own += own_weight[:, None] * grad_out.to(tl.float32)
    store_rows((GradVOwn + slab * num_queries * VALUE_DIM, VALUE_DIM), rows, num_queries, grad_v_own, VALUE_DIM)
