"""The fused forward kernel of p-Laplacian attention, FlashAttention-2 style.

One program per (query block, batch * head) loops over key tiles with an online softmax (running max and sum in
float32): the numerator accumulates exp(s - m) * P @ V, the denominator exp(s - m) alone, since softmax is normalised
before the multiplication by P. Scores are in log2 units (one exp2 each, log2(e) / sqrt(d) folded into the scale); D2
+ eps comes from the values' norms, computed once per call and squared here, and the matmul -2 v_x.v_y; P = (D2 +
eps) ** ((p - 2) / 2) in float32 (``power``). Saves the output, the row logsumexp (base 2) and, for euler,
1 - rowsum(W_off).

The kernel runs twice over its grid (``PASS``): a first pass with the distances' expansion alone, then an exact pass
over the blocks where it met close pairs of values (``distances``), which also flags the key tiles where it met them,
for the backward; small calls run the exact pass alone.
"""

from __future__ import annotations

from .triton_tiles import (
    EXACT_PASS, FIRST_PASS, FLOAT32_DOT, MIN_SCORE, any_set, close_bounds, distances, fixed_documents, float32_scalars,
    jit, key_loop_bounds, load_rows, load_vector, masked_scores, pair_dot, power, program_ids, runs_head, slab_rows,
    squared_norms, store_rows, tile_start, times_minus_two, tl,
)  # fmt: skip


@jit
def _forward_tile(row_max, row_sum, off_sum, acc, queries, keys, head, sizes, start, HEAD_DIM: tl.constexpr,
                  VALUE_DIM: tl.constexpr, BLOCK_N: tl.constexpr, POWER: tl.constexpr, MASKED: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
                  HAS_DOCUMENTS: tl.constexpr, EULER: tl.constexpr, PASS: tl.constexpr,
                  CHUNK: tl.constexpr):  # fmt: skip
    """The online softmax's state after the key tile at ``start``, and which of the block's queries met close pairs
    in it (the exact pass after a first one flags its key tile for the backward). With CHUNK, ``q`` is the block's
    rows in memory and the products over the head sizes load both sides CHUNK columns at a time (``pair_dot``)."""
    rows, q, v_query_m2, sq_query_eps, bounds = queries
    K, V, Norms, KeyTiles, masks = keys
    scale_log2, exponent, eps = head
    num_queries, num_keys = sizes
    cols = start + tl.arange(0, BLOCK_N)  # [BN]
    if CHUNK:
        k = (K, cols, num_keys)
    else:
        k = load_rows(K, cols, num_keys, HEAD_DIM, q.shape[1], MASKED)  # [BN, BD]
    values = load_rows(V, cols, num_keys, VALUE_DIM, acc.shape[1], MASKED)  # [BN, BDV]
    key_norms = load_vector(Norms, cols, num_keys, 0.0, MASKED)  # [BN]
    # q.k unscaled: the scale (> 0) multiplies the row maxima, and joins each score's exp2 argument as one FMA.
    scores = masked_scores(pair_dot(q, k, 0, None, CHUNK, HEAD_DIM), rows, cols, sizes, masks, MASKED=MASKED,
                           IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_KEY_MASK=HAS_KEY_MASK,
                           HAS_DOCUMENTS=HAS_DOCUMENTS, QUERY_AXIS=0)  # [BM, BN]  # fmt: skip
    new_max = tl.maximum(row_max, tl.max(scores, 1) * scale_log2)  # [BM]
    rescale = tl.exp2(row_max - new_max)
    expo = tl.exp2(tl.fma(scores, scale_log2, -new_max[:, None]))  # [BM, BN]
    row_sum = tl.fma(row_sum, rescale, tl.sum(expo, 1))
    # [BM, BN] distances + eps, [BM, BN] self pairs, [BM] rows with close pairs
    dist_eps, is_self, has_close = distances((v_query_m2, sq_query_eps), (values, key_norms), bounds, V, rows, cols,
                                             num_keys, num_keys - num_queries, eps, VALUE_DIM=VALUE_DIM, MASKED=MASKED,
                                             QUERY_AXIS=0, EXACT=PASS != FIRST_PASS, CHUNK=CHUNK)  # fmt: skip
    if PASS == EXACT_PASS:
        if any_set(has_close):
            tl.store(KeyTiles + start // BLOCK_N, 1)
    weights = expo * power(dist_eps, exponent, POWER)[0]  # [BM, BN]
    if EULER:
        if MASKED:
            weights = tl.where(is_self, 0.0, weights)
        off_sum = tl.fma(off_sum, rescale, tl.sum(weights, 1))
    acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=FLOAT32_DOT)
    return new_max, row_sum, off_sum, acc, has_close


# high_heads is a bit mask, not a size: one compilation serves every layout of p; stats_plane varies with the batch.
@jit(do_not_specialize=["high_heads", "stats_plane"])
def plap_forward_kernel(
    Q, K, V, Norms, KeyKeep, Documents, Out, Lse, ExactBlocks, KeyTiles,
    head_start, run_heads, num_heads, num_queries, num_keys, window, scale_log2, exponent_low, exponent_high,
    high_heads, eps, stats_plane,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POWER: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, EULER: tl.constexpr,
    PASS: tl.constexpr, HEAD_CHUNK: tl.constexpr,
    Q_ROW_STRIDE: tl.constexpr, K_ROW_STRIDE: tl.constexpr, V_ROW_STRIDE: tl.constexpr, OUT_ROW_STRIDE: tl.constexpr,
):  # fmt: skip
    """The first pass (``PASS``, ``triton_tiles.FIRST_PASS``) computes D2 + eps by the expansion alone; a block with a
    close pair in any tile stores nothing but its flag in ExactBlocks (int32 per block, written by every program), and
    each program zeroes its share of KeyTiles (int32 per key tile of BLOCK_N). The exact pass redoes the flagged blocks
    with the close pairs' direct differences, and sets KeyTiles where a tile had some; the others leave at once. The
    exact path's code and registers stay out of the first pass, which fits more blocks per SM. (A flagged block's
    first-pass values may be inf or NaN where the expansion went to zero or below: never stored.) The exact pass alone
    runs every block and reads or writes no flag. Each program's head has its own p (``program_ids``). HEAD_CHUNK
    (float32 above 64 columns) keeps the block's queries and values in memory, read HEAD_CHUNK columns at a time in
    each tile (``pair_dot``); 0 holds them in registers."""
    scale_log2, exponent_low, exponent_high, eps = float32_scalars(scale_log2, exponent_low, exponent_high, eps)
    pid_m, slab, exponent = program_ids(num_queries, head_start, run_heads, num_heads, high_heads, exponent_low,
                                        exponent_high, BLOCK_M, IS_CAUSAL)  # fmt: skip
    if not runs_head(exponent, POWER):
        return
    exact_block = ExactBlocks + slab * tl.cdiv(num_queries, BLOCK_M) + pid_m
    if PASS == EXACT_PASS:
        if tl.load(exact_block) == 0:  # not flagged: leave before loading anything (the pass's grid is the first's)
            return
    offset = num_keys - num_queries  # query i is the token at key position offset + i
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    Q = slab_rows(Q, slab, num_heads, (stride_qb, stride_qh, Q_ROW_STRIDE))
    K = slab_rows(K, slab, num_heads, (stride_kb, stride_kh, K_ROW_STRIDE))
    V = slab_rows(V, slab, num_heads, (stride_vb, stride_vh, V_ROW_STRIDE))
    Norms += slab * num_keys
    KeyTiles += slab * tl.cdiv(num_keys, BLOCK_N)
    if PASS == FIRST_PASS:  # the exact pass sets the flags of the key tiles where it meets close pairs
        for tile in range(pid_m, tl.cdiv(num_keys, BLOCK_N), tl.cdiv(num_queries, BLOCK_M)):
            tl.store(KeyTiles + tile, 0)
    stats = slab * num_queries  # Lse is (1 + EULER, B, H, Nq): the logsumexp, then euler's own weights
    if HEAD_CHUNK:  # distances reads the values from V; euler loads them after the loop
        q = (Q, rows, num_queries)
        v_query = 0.0
    else:
        q = load_rows(Q, rows, num_queries, HEAD_DIM, BLOCK_D)  # [BM, BD]
        v_query = load_rows(V, rows + offset, num_keys, VALUE_DIM, BLOCK_DV)  # [BM, BDV]
    sq_query_eps = squared_norms(Norms + offset, rows, num_queries) + eps  # [BM]
    docs, span = fixed_documents(Documents if HAS_DOCUMENTS else None, slab, num_heads, rows, num_keys,
                                 HAS_DOCUMENTS)
    queries = (rows, q, v_query if HEAD_CHUNK else times_minus_two(v_query), sq_query_eps,
               close_bounds(sq_query_eps, eps, 0))
    keys = (K, V, Norms, KeyTiles, (KeyKeep + (slab // num_heads) * num_keys, docs, window))
    sizes = (num_queries, num_keys)
    plain, masked = key_loop_bounds(pid_m, num_queries, num_keys, window, span, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
                                    HAS_KEY_MASK)  # fmt: skip
    head = (scale_log2, exponent, eps)
    row_max = tl.full([BLOCK_M], MIN_SCORE, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    off_sum = tl.zeros([BLOCK_M], tl.float32)  # rowsum(W_off) * running normaliser, euler only
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # [BM, BDV]
    has_close = tl.zeros([BLOCK_M], tl.int32)  # per query: whether its tiles had close pairs
    for phase in tl.static_range(2):  # the plain tiles (all pairs allowed, off the diagonal), then the masked ones
        tiles = plain if phase == 0 else masked
        for index in range(0, tiles[0]):
            row_max, row_sum, off_sum, acc, close = _forward_tile(
                row_max, row_sum, off_sum, acc, queries, keys, head, sizes, tile_start(index, tiles, BLOCK_N),
                HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, BLOCK_N=BLOCK_N, POWER=POWER, MASKED=phase == 1,
                IS_CAUSAL=IS_CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_KEY_MASK=HAS_KEY_MASK, HAS_DOCUMENTS=HAS_DOCUMENTS,
                EULER=EULER, PASS=PASS, CHUNK=HEAD_CHUNK,
            )  # fmt: skip
            has_close |= close

    if PASS == FIRST_PASS:  # a block with close pairs stores only its flag, for the exact pass
        block_flag = tl.max(has_close)
        tl.store(exact_block, block_flag)
        stored_rows = tl.where(block_flag != 0, 0, num_queries)
    else:
        stored_rows = num_queries
    row_in = rows < stored_rows
    valid = row_sum > 0  # at least one allowed key; fully masked rows output zeros
    inv_sum = 1.0 / tl.where(valid, row_sum, 1.0)
    out = acc * inv_sum[:, None]  # [BM, BDV]
    if EULER:
        own_weight = tl.where(valid, 1.0 - off_sum * inv_sum, 0.0)  # u_x = v_x (1 - rowsum W_off) + W_off V
        if HEAD_CHUNK:
            v_query = load_rows(V, rows + offset, num_keys, VALUE_DIM, BLOCK_DV)  # [BM, BDV]
        out += own_weight[:, None] * v_query.to(tl.float32)
        tl.store(Lse + stats_plane + stats + rows, own_weight, mask=row_in)  # stats_plane = B * H * Nq
    Out = slab_rows(Out, slab, num_heads, (stride_ob, stride_oh, OUT_ROW_STRIDE))
    store_rows(Out, rows, stored_rows, out, VALUE_DIM)
    # In log2 units; +inf on fully masked rows makes the backward's exp2(s - lse) exactly 0 there.
    lse = row_max + tl.log2(tl.where(valid, row_sum, 1.0))
    tl.store(Lse + stats + rows, tl.where(valid, lse, float("inf")), mask=row_in)
