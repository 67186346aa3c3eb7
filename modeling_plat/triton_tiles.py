"""What the fused kernels share (``triton_forward``, ``triton_backward``): program ids, loads, the p-Laplacian power,
the distances and their close pairs, masks, the loops' bounds and the exact passes' flags.

Tiles pair queries with keys. The forward and dQ kernels hold a block of queries fixed and see tiles as
(queries, keys), ``QUERY_AXIS = 0``; dK/dV holds a block of keys and sees (keys, queries), ``QUERY_AXIS = 1``, so that
each kernel's fixed block is the left operand of its matmuls: split over the warps, not repeated in every warp as a
right operand is. Shapes in comments: BM and BN are the tile's queries and keys, BF and BL the fixed block's rows and
the loop tile's, BD and BDV the padded head sizes of queries/keys and of values.

``import triton`` sits in try/except so that the package imports without Triton (remote code scans the imports); the
kernels are then never launched. On CPU they run under the Triton interpreter when TRITON_INTERPRET=1 is set before
import.
"""

from __future__ import annotations

import math

from .plap_attention_reference import CLOSE_PAIR as _CLOSE_PAIR
from .plap_attention_reference import COINCIDING as _COINCIDING

try:
    import triton
    import triton.language as tl

    jit = triton.jit
    constexpr = tl.constexpr
except ImportError:
    triton = tl = None

    def jit(fn=None, **options):
        return fn if fn is not None else (lambda function: function)

    def constexpr(value):  # annotations and constants below; nothing is compiled without Triton
        return value


# Precision of every matmul with float32 operands: TF32 alone keeps 10 mantissa bits, too few for distances.
FLOAT32_DOT = constexpr("tf32x3")
# Keeps the sign, the exponent and the 10 mantissa bits of TF32 of a float32.
TF32_MASK = constexpr(0xFFFFE000)
# Keeps the sign, the exponent and the 7 mantissa bits of a bfloat16.
BFLOAT16_MASK = constexpr(0xFFFF0000)
LN_2 = constexpr(math.log(2))
# Row max start: finite, so that rows with no allowed key so far give exp(-inf - MIN) = 0, never NaN.
MIN_SCORE = constexpr(-1.0e38)
# Columns of the tile of ones against which the distance gradient's bfloat16 parts give their row sums (a matmul's
# smallest width).
SUM_COLUMNS = constexpr(16)
# The reference's rules for close and coinciding pairs, as constants a compiled kernel can read.
CLOSE_PAIR = constexpr(_CLOSE_PAIR)
COINCIDING = constexpr(_COINCIDING)


@jit
def _probe():
    pass


# Under the interpreter triton.jit returns interpreted functions instead of JITFunctions.
INTERPRETED = triton is not None and not isinstance(_probe, triton.runtime.JITFunction)
# The interpreter cannot run inline PTX: it takes numpy's functions instead (``_log2``, ``_reciprocal``).
INLINE_PTX = constexpr(not INTERPRETED)
# Exponent classes of (D2 + eps) ** ((p - 2) / 2), one compiled into each launch: any p through log2 and exp2, and
# the paper's p = 1.5 and 2.5 (exponents -1/4 and 1/4) as square-root chains, two special-function operations
# instead of three, each in a class of its own or both in one (two more instructions per score, each head's sign
# read at run time).
POWER_ANY, POWER_MINUS_QUARTER, POWER_QUARTER, POWER_QUARTERS = constexpr(0), constexpr(1), constexpr(2), constexpr(3)
QUARTER_CLASSES = {1.5: POWER_MINUS_QUARTER, 2.5: POWER_QUARTER}  # each p's own class; both at once: POWER_QUARTERS
# Passes of a kernel over its grid: the first (the distances' expansion alone; a forward block with close pairs stores
# only its flag), the exact one over the blocks the forward flagged, or the exact one alone over every block (small
# calls: one launch per kernel, no flags).
FIRST_PASS, EXACT_PASS, EXACT_ALONE = constexpr(0), constexpr(1), constexpr(2)


# ------------------------------------------------------------------------------------------------ programs and loads


@jit
def program_ids(num_rows, head_start, run_heads, num_heads, high_heads, exponent_low, exponent_high,
                BLOCK: tl.constexpr, HEAVY_LAST: tl.constexpr):  # fmt: skip
    """(row block, batch * H + head, the head's exponent (p - 2) / 2) of this program, for a run of heads head_start
    ... + run_heads whose p takes at most two values: bit h of ``high_heads`` says that head head_start + h takes
    ``exponent_high``. The grid is 1-D (CUDA caps axes 1 and 2 at 65535) and starts the longest loops first: a GPU
    starts programs in grid order, so that the short ones fill the last wave. The slabs (batch, head) vary fastest, and
    the row blocks go from the heaviest to the lightest: the last first where the loops grow with the block
    (HEAVY_LAST: query blocks under causal masking), else the first. The slab index is int64, as B * H * N * d may
    pass 2^31."""
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(num_rows, BLOCK)
    slabs = tl.num_programs(0) // num_blocks
    block = pid // slabs
    if HEAVY_LAST:
        block = num_blocks - 1 - block
    slab = pid % slabs
    run_head = slab % run_heads
    exponent = tl.where(((high_heads >> run_head) & 1) != 0, exponent_high, exponent_low)
    return block, (slab // run_heads).to(tl.int64) * num_heads + head_start + run_head, exponent


@jit
def float32_scalars(scale_log2, exponent_low, exponent_high, eps):
    """A launch's float arguments in float32. torch.compile's launcher may type Python floats as float64 (Inductor's
    signature of floats), which would carry float64 into every tile they touch and mismatch the matmuls' float32
    accumulators."""
    return (tl.cast(scale_log2, tl.float32), tl.cast(exponent_low, tl.float32), tl.cast(exponent_high, tl.float32),
            tl.cast(eps, tl.float32))  # fmt: skip


@jit
def slab_rows(ptr, slab, num_heads, strides):
    """The rows of one (batch, head) of a (B, H, N, C) tensor whose columns are contiguous, as (pointer to its first
    row, row stride): a ``matrix`` of the functions below. ``strides`` are the tensor's (batch, head, row) strides in
    elements, so that q, k, v, the output and the gradients keep the layout a model's projections give them
    (tokens-major, heads inside) with no copy; ``slab`` is batch * num_heads + head, int64."""
    batch_stride, head_stride, row_stride = strides
    return ptr + (slab // num_heads) * batch_stride + (slab % num_heads) * head_stride, row_stride


@jit
def rows_from(matrix, first):
    """The rows of ``matrix`` from row ``first`` on."""
    ptr, row_stride = matrix
    return ptr + first * row_stride, row_stride


@jit
def row_ptrs(matrix, rows, COLS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Pointers and mask of ``rows`` of a (rows, COLS) ``matrix`` (pointer, row stride), padded to BLOCK_COLS
    columns."""
    ptr, row_stride = matrix
    cols = tl.arange(0, BLOCK_COLS)
    return ptr + rows[:, None] * row_stride + cols[None, :], cols[None, :] < COLS


@jit
def load_rows(matrix, rows, num_rows, COLS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHECK_ROWS: tl.constexpr = True):
    """(len(rows), BLOCK_COLS) tile of a (num_rows, COLS) ``matrix`` (pointer, row stride); zeros outside it. A plain
    tile's rows are all inside (CHECK_ROWS false): its loads skip the per-row predicates, which cost a loop iteration
    instructions."""
    ptrs, col_in = row_ptrs(matrix, rows, COLS, BLOCK_COLS)
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < num_rows) & col_in, other=0.0)
    elif COLS == BLOCK_COLS:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=col_in, other=0.0)
    return tile


@jit
def load_vector(ptr, index, size, other, CHECK: tl.constexpr = True):
    """ptr[index], ``other`` where index >= size (CHECK false: every index is inside)."""
    if CHECK:
        vector = tl.load(ptr + index, mask=index < size, other=other)
    else:
        vector = tl.load(ptr + index)
    return vector


@jit
def squared_norms(Norms, index, size):
    """The squared norms of a fixed block's values at ``index`` (0 where index >= size), from their float32 norms (one
    ATen reduction before the forward); a loop tile's are squared inside ``distances``."""
    norms = load_vector(Norms, index, size, 0.0)
    return norms * norms


@jit
def store_rows(matrix, rows, num_rows, tile, COLS: tl.constexpr):
    """Stores the rows of ``tile`` that lie inside a (num_rows, COLS) ``matrix`` (pointer, row stride), in its
    dtype."""
    ptrs, col_in = row_ptrs(matrix, rows, COLS, tile.shape[1])
    tl.store(ptrs, tile.to(matrix[0].dtype.element_ty), mask=(rows[:, None] < num_rows) & col_in)



# ------------------------------------------------------------------------------------------------ the power


@jit
def _log2(x):
    if INLINE_PTX:  # MUFU.LG2; tl.log2 is libdevice's software logarithm, ~30 instructions
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return tl.log2(x)


@jit
def _reciprocal(x):
    if INLINE_PTX:  # MUFU.RCP; 1 / x is a correctly rounded division, about 8 instructions
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return 1.0 / x


@jit
def power(dist_eps, exponent, POWER: tl.constexpr):
    """P = dist_eps ** exponent and 1 / dist_eps, with approximate special functions (relative error ~2^-22). The
    paper's classes take square roots: rsqrt then sqrt for -1/4 (1 / dist_eps its square), two sqrt for 1/4 and a
    reciprocal; both in one launch, r = rsqrt(dist_eps) then P = sqrt(r * t) with t = dist_eps for 1/4 and 1 for -1/4,
    one FMA from the head's sign (``rising``, 1.0 or 0.0, the same in all of a program's threads), and 1 / dist_eps =
    r * r. The forward, which needs no 1 / dist_eps, drops it unused."""
    if POWER == POWER_ANY:
        log = _log2(dist_eps)
        return tl.exp2(exponent * log), tl.exp2(-log)
    elif POWER == POWER_MINUS_QUARTER:
        rsqrt = tl.rsqrt(dist_eps)
        return tl.sqrt(rsqrt), rsqrt * rsqrt
    elif POWER == POWER_QUARTER:
        return tl.sqrt(tl.sqrt(dist_eps)), _reciprocal(dist_eps)
    else:
        rsqrt = tl.rsqrt(dist_eps)
        rising = tl.where(exponent > 0, 1.0, 0.0)
        return tl.sqrt(rsqrt * tl.fma(dist_eps, rising, 1.0 - rising)), rsqrt * rsqrt


@jit
def class_exponent(exponent, POWER: tl.constexpr):
    """The exponent (p - 2) / 2, a compile-time constant where its class fixes it."""
    if POWER == POWER_MINUS_QUARTER:
        exponent = -0.25
    elif POWER == POWER_QUARTER:
        exponent = 0.25
    return exponent


@jit
def runs_head(exponent, POWER: tl.constexpr):
    """Whether a launch of this class runs a head of this exponent: a class of one sign runs the heads of its p (the
    run's other heads are another launch's), the others every head of the run."""
    if POWER == POWER_MINUS_QUARTER:
        runs = exponent < 0
    elif POWER == POWER_QUARTER:
        runs = exponent > 0
    else:
        runs = True
    return runs


# ------------------------------------------------------------------------------------------------ exact matmuls


@jit
def _split_high(x, MASK: tl.constexpr):
    """x with the low mantissa bits that MASK clears set to zero (exact in the narrower type that keeps the rest)."""
    return (x.to(tl.uint32, bitcast=True) & MASK).to(tl.float32, bitcast=True)


@jit
def row_sums_init(rows: tl.constexpr, values_dtype: tl.constexpr, BY_MATMUL: tl.constexpr):
    """The zero accumulator of ``exact_dot``'s row sums: (rows, SUM_COLUMNS) where a matmul forms them, (rows,)
    otherwise."""
    if BY_MATMUL and values_dtype == tl.bfloat16:
        sums = tl.zeros([rows, SUM_COLUMNS], tl.float32)
    else:
        sums = tl.zeros([rows], tl.float32)
    return sums


@jit
def row_sums(sums):
    """Each row's sum from ``exact_dot``'s accumulator (its columns are equal where it has several)."""
    if len(sums.shape) == 2:
        sums = tl.max(sums, 1)
    return sums


@jit
def _part_dot(part, b, acc, sums, BY_MATMUL: tl.constexpr):
    """``exact_dot``'s matmul and row sums of one bfloat16 part."""
    part = part.to(tl.bfloat16)
    if BY_MATMUL:
        sums = tl.dot(part, tl.full([part.shape[1], SUM_COLUMNS], 1.0, tl.bfloat16), sums)
    else:
        sums += tl.sum(part.to(tl.float32), 1)
    return tl.dot(part, b, acc), sums


@jit
def exact_dot(a, b, acc, sums, EXACT: tl.constexpr, SUMS_BY_MATMUL: tl.constexpr):
    """(acc + a @ b, sums + rowsum(a)) for a float32 ``a`` (a distance gradient) and half-precision ``b``, whose
    products are exact: ``a`` alone is rounded or split. The caller forms rowsum(a) v_x - a V, whose terms cancel
    where values are near: against bfloat16 the row sums come from the very parts the matmul takes (a matmul against
    a tile of ones, ``row_sums_init``, or their float32 sums), so that the cancellation is exact and each term keeps
    its parts' rounding. The first pass takes ``a`` rounded to bfloat16 (2^-9 of each term, as W^T dU has of W's
    rounding): its blocks have no close pair. The exact pass splits it into three bfloat16 parts (24 bits, float32's)
    for the close pairs' terms, which dominate dV where values nearly coincide. 16-bit operands keep the accumulator's
    register layout, so that no part is shuffled to another. Against float16, whose range cannot hold ``a``, two TF32
    parts (not tf32x3's three) against float32 row sums."""
    if b.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision=FLOAT32_DOT)
        sums += tl.sum(a, 1)
    elif b.dtype == tl.bfloat16:
        if EXACT:
            a_high = _split_high(a, BFLOAT16_MASK)
            a_mid = _split_high(a - a_high, BFLOAT16_MASK)
            acc, sums = _part_dot(a - a_high - a_mid, b, acc, sums, SUMS_BY_MATMUL)  # the smallest part first
            acc, sums = _part_dot(a_mid, b, acc, sums, SUMS_BY_MATMUL)
            acc, sums = _part_dot(a_high, b, acc, sums, SUMS_BY_MATMUL)
        else:
            acc, sums = _part_dot(a, b, acc, sums, SUMS_BY_MATMUL)
    else:
        b = b.to(tl.float32)
        a_high = _split_high(a, TF32_MASK)
        acc = tl.dot(a_high, b, acc, input_precision="tf32")
        acc = tl.dot(a - a_high, b, acc, input_precision="tf32")
        sums += tl.sum(a, 1)
    return acc, sums


# ------------------------------------------------------------------------------------------------ tiles


@jit
def per_query(vector, QUERY_AXIS: tl.constexpr):
    """A vector over the queries of a tile, broadcastable against the tile."""
    return tl.expand_dims(vector, 1 - QUERY_AXIS)


@jit
def per_key(vector, QUERY_AXIS: tl.constexpr):
    """A vector over the keys of a tile, broadcastable against the tile."""
    return tl.expand_dims(vector, QUERY_AXIS)


@jit
def _rows_dot(query_side, key_side, QUERY_AXIS: tl.constexpr, acc):
    if QUERY_AXIS == 0:
        tile = tl.dot(query_side, tl.trans(key_side), acc, input_precision=FLOAT32_DOT)
    else:
        tile = tl.dot(key_side, tl.trans(query_side), acc, input_precision=FLOAT32_DOT)
    return tile


@jit
def _load_chunk(rows, start, COLS: tl.constexpr, CHUNK: tl.constexpr):
    """Columns [start, start + CHUNK) of ``rows`` (``pair_dot``'s (matrix, positions, number of rows)), zeros outside
    the (number of rows, COLS) matrix."""
    matrix, positions, num_rows = rows
    ptrs, _ = row_ptrs((matrix[0] + start, matrix[1]), positions, COLS, CHUNK)
    col_in = start + tl.arange(0, CHUNK) < COLS
    return tl.load(ptrs, mask=(positions[:, None] < num_rows) & col_in[None, :], other=0.0)


@jit
def pair_dot(query_side, key_side, QUERY_AXIS: tl.constexpr, acc=None, CHUNK: tl.constexpr = 0,
             COLS: tl.constexpr = 0):  # fmt: skip
    """The tile of dot products of query-side rows [BM, d] with key-side rows [BN, d], added to ``acc`` if given.

    With CHUNK, each side is (matrix, positions, number of rows) of rows of a (number of rows, COLS) matrix
    (``row_ptrs``), and the products run over CHUNK columns at a time, each loaded in the step that takes it: float32
    rows above 64 columns, held whole, would sit in every warp that multiplies them (a 16-row operand of 128 float32
    columns is 64 registers per thread, tf32x3 holds two copies), so that a kernel's fixed block would spill inside its
    loop."""
    if CHUNK:
        if acc is None:
            if QUERY_AXIS == 0:
                tile = tl.zeros([query_side[1].shape[0], key_side[1].shape[0]], tl.float32)
            else:
                tile = tl.zeros([key_side[1].shape[0], query_side[1].shape[0]], tl.float32)
        else:
            tile = acc
        # A loop (not unrolled, so that the fixed block's loads stay inside it) over the padded width, as every size of
        # a bucket runs it: three steps at head size 96 spilled inside the kernels' loops, four did not.
        for start in range(0, triton.next_power_of_2(COLS), CHUNK):
            tile = _rows_dot(_load_chunk(query_side, start, COLS, CHUNK), _load_chunk(key_side, start, COLS, CHUNK),
                             QUERY_AXIS, tile)  # fmt: skip
    else:
        tile = _rows_dot(query_side, key_side, QUERY_AXIS, acc)
    return tile


@jit
def fixed_documents(Documents, slab, num_heads, positions, num_keys, HAS_DOCUMENTS: tl.constexpr):
    """What the tiles of a kernel's fixed block need of packed documents: (the row of the document table,
    the block's document ids, their smallest and largest id), and the span (first, end) of positions that
    its tokens may pair with. Without documents, the span of the whole row, and ``Documents`` is None: torch.compile's
    analysis of a kernel (which tensors it writes) takes what a call returns as derived from every pointer that the
    call is given, and the loop bounds would make the exact pass's flag stores look like stores to the placeholder,
    which aliases other arguments."""
    if HAS_DOCUMENTS:
        row = Documents + (slab // num_heads) * num_keys * 3
        inside = positions < num_keys
        ids = tl.load(row + positions * 3, mask=inside, other=-1)  # [BF]
        docs = (row, ids, tl.min(tl.where(inside, ids, num_keys)), tl.max(ids))
        first = tl.min(tl.load(row + positions * 3 + 1, mask=inside, other=num_keys))
        span = (first, tl.max(tl.load(row + positions * 3 + 2, mask=inside, other=0)))
    else:
        docs = (0, 0, 0, 0)
        span = (0, num_keys)
    return docs, span


@jit
def masked_scores(scores, rows, cols, sizes, masks, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
                  QUERY_AXIS: tl.constexpr):  # fmt: skip
    """-inf where query ``rows`` may not attend to key ``cols`` (out of range, causal, outside the sliding window,
    padding, another document); tiles that the loop split proves whole and allowed (MASKED false) skip the test, and
    with documents they compare ids only where the tile's tokens are not all of the fixed block's one document.
    ``sizes`` is (num_queries, num_keys), ``masks`` (the key-padding row, ``fixed_documents``' docs, the window)."""
    num_queries, num_keys = sizes
    key_keep_row, docs, window = masks
    if HAS_DOCUMENTS:  # tiles are (fixed block, loop block); Nq == Nk
        row, fixed_ids, fixed_low, fixed_high = docs
        loop_positions = cols if QUERY_AXIS == 0 else rows
        loop_ids = tl.load(row + loop_positions * 3, mask=loop_positions < num_keys, other=-1)
        same_document = fixed_ids[:, None] == loop_ids[None, :]
    if MASKED:
        query_pos = per_query(rows, QUERY_AXIS)
        key_pos = per_key(cols, QUERY_AXIS)
        allowed = (query_pos < num_queries) & (key_pos < num_keys)
        if IS_CAUSAL:
            allowed = allowed & (key_pos <= query_pos + (num_keys - num_queries))
        if HAS_WINDOW:  # keys in (x - window, x] of the query at key position x
            allowed = allowed & (key_pos > query_pos + (num_keys - num_queries) - window)
        if HAS_KEY_MASK:
            keep = tl.load(key_keep_row + cols, mask=cols < num_keys, other=0)
            allowed = allowed & (per_key(keep, QUERY_AXIS) != 0)
        if HAS_DOCUMENTS:
            allowed = allowed & same_document
        scores = tl.where(allowed, scores, float("-inf"))
    elif HAS_DOCUMENTS:
        # Every id equal: min(loop) = max(fixed) >= min(fixed) = max(loop) >= min(loop).
        if (tl.min(loop_ids) != fixed_high) | (tl.max(loop_ids) != fixed_low):
            scores = tl.where(same_document, scores, float("-inf"))
    return scores


# ------------------------------------------------------------------------------------------------ distances


@jit
def close_bounds(sq_fixed_eps, eps, QUERY_AXIS: tl.constexpr):
    """Per row of a kernel's fixed block, the distance (D2 + eps) at or below which a plain tile's row has a close pair.
    Queries (forward, dq): the pair rule itself, CLOSE_PAIR (|v_x|^2 + eps) + eps. Keys (dkdv's exact pass): a wider
    net computed once per program, 2 CLOSE_PAIR (|v_y|^2 + eps) + eps, which holds every pair that the rule calls close
    (docs/numerics.md)."""
    if QUERY_AXIS == 0:
        bounds = sq_fixed_eps * CLOSE_PAIR + eps
    else:
        bounds = sq_fixed_eps * (2 * CLOSE_PAIR) + eps
    return bounds


@jit
def times_minus_two(values):
    """-2 values, exact in any float type: the query values that ``distances`` takes where queries are the fixed
    block."""
    return (values.to(tl.float32) * -2.0).to(values.dtype)


@jit
def any_set(flags):
    return tl.max(flags) != 0


@jit
def distances(query_side, key_side, bounds, V, rows, cols, num_keys, offset, eps, VALUE_DIM: tl.constexpr,
              MASKED: tl.constexpr, QUERY_AXIS: tl.constexpr, EXACT: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """D2 + eps of a tile from the norms and the values, the self-pair tile (all false where the loop split excludes
    self pairs, MASKED false), and which rows of the tile (the fixed block's) have close pairs (int32 per row: a loop
    accumulates them without reducing across warps in every tile). ``query_side`` and ``key_side`` are (values, norms)
    of the tile's queries and keys: the fixed block's squared, with eps (once per program, not in the loop), the loop
    tile's as they are, squared by the FMA that adds them to the fixed block's (a square per tile row would be repeated
    in every thread that holds a score of it). Where queries are the fixed block (forward, dq) their values come as
    -2 v_x (``times_minus_two``), so that the matmul accumulates -2 v_x.v_y onto the norms; dk/dv's fixed values also
    form G = dU V^T, so that it scales the products instead. ``bounds`` are ``close_bounds``. With CHUNK the
    values' matmul reads both sides from V, CHUNK columns at a time (``pair_dot``), and the values of ``query_side``
    and ``key_side`` are not read.

    The expansion's rounding, a few u (|v_x|^2 + |v_y|^2), would decide P where values nearly coincide: a tile with
    close pairs (CLOSE_PAIR) recomputes all its pairs by direct differences, one value coordinate at a time from
    memory (no second tile and no mask stay live across that loop), and sets its coinciding pairs (COINCIDING) to
    exactly eps. Self pairs are exactly eps without it, and pairs outside the inputs are masked: in the masked tiles
    (the diagonal band, the partial ones) neither makes the tile recompute. Elsewhere the expansion is positive.
    Without EXACT the tile keeps the expansion and only reports its close pairs (the forward's first pass reads them,
    the backward's, whose blocks the forward has cleared, leave them unused)."""
    v_query, query_norms = query_side
    values, key_norms = key_side
    if CHUNK:
        value_dot = pair_dot((V, rows + offset, num_keys), (V, cols, num_keys), QUERY_AXIS, None, CHUNK, VALUE_DIM)
    if QUERY_AXIS == 0:  # the queries are the fixed block
        loop_norms = per_key(key_norms, QUERY_AXIS)
        sq_sums = tl.fma(loop_norms, loop_norms, per_query(query_norms, QUERY_AXIS))  # [BF, BL]
        dist_eps = tl.fma(value_dot, -2.0, sq_sums) if CHUNK else pair_dot(v_query, values, QUERY_AXIS, sq_sums)
        sq_query_eps = query_norms
    else:
        loop_norms = per_query(query_norms, QUERY_AXIS)
        sq_sums = tl.fma(loop_norms, loop_norms, per_key(key_norms, QUERY_AXIS))  # [BF, BL]
        dist_eps = tl.fma(value_dot if CHUNK else pair_dot(v_query, values, QUERY_AXIS), -2.0, sq_sums)
        sq_query_eps = tl.fma(query_norms, query_norms, eps)
    is_self = per_key(cols, QUERY_AXIS) == per_query(rows, QUERY_AXIS) + offset
    if MASKED:
        inside = (per_query(rows, QUERY_AXIS) < num_keys - offset) & (per_key(cols, QUERY_AXIS) < num_keys)
        close = dist_eps <= per_query(sq_query_eps * CLOSE_PAIR + eps, QUERY_AXIS)
        close_rows = tl.max((close & inside & ~is_self).to(tl.int32), 1)  # [BF]
    else:
        # One comparison per row, not per pair: the row's nearest pair against the row's bound.
        close_rows = (tl.min(dist_eps, 1) <= bounds).to(tl.int32)
    if EXACT and any_set(close_rows):
        query_in, key_in = rows < num_keys - offset, cols < num_keys
        dist_eps = tl.zeros_like(dist_eps)
        for dim in range(VALUE_DIM):
            query_value = tl.load(V[0] + (rows + offset) * V[1] + dim, mask=query_in, other=0.0).to(tl.float32)
            key_value = tl.load(V[0] + cols * V[1] + dim, mask=key_in, other=0.0).to(tl.float32)
            diff = per_query(query_value, QUERY_AXIS) - per_key(key_value, QUERY_AXIS)
            dist_eps = tl.fma(diff, diff, dist_eps)
        bound = COINCIDING * (sq_sums - eps)
        dist_eps = tl.where(dist_eps <= bound, 0.0, dist_eps) + eps
    if MASKED:
        dist_eps = tl.where(is_self, eps, dist_eps)
    return dist_eps, is_self & MASKED, close_rows


# ------------------------------------------------------------------------------------------------ loops and passes


@jit
def _loop_split(begin, a, b, c, end, span, BLOCK: tl.constexpr):
    """The tiles of a loop over [begin, end) as two lists: plain tiles [begin, a) and [b, c), whose pairs are
    all allowed (but for packed documents), in range and off the diagonal, and masked tiles [a, b) and
    [max(b, c), end); tiles outside the span (first, end) of positions that the fixed block pairs with are
    skipped. Each list is (count, count of its first range, first start, second start), read by
    ``tile_start``; a, b and c are multiples of BLOCK from begin wherever a range follows them."""
    low = tl.maximum(begin, begin + (span[0] - begin) // BLOCK * BLOCK)
    high = begin + tl.cdiv(span[1] - begin, BLOCK) * BLOCK
    begin, a, b, c = tl.maximum(begin, low), tl.maximum(a, low), tl.maximum(b, low), tl.maximum(c, low)
    end = tl.minimum(end, high)
    a_end, b_end, c_end = tl.minimum(a, high), tl.minimum(b, high), tl.minimum(c, high)
    first_plain = tl.maximum(a_end - begin, 0) // BLOCK
    plain = (first_plain + tl.maximum(c_end - b, 0) // BLOCK, first_plain, begin, b)
    first_masked = tl.cdiv(tl.maximum(b_end - a, 0), BLOCK)
    second = tl.maximum(b, c)
    masked = (first_masked + tl.cdiv(tl.maximum(end - second, 0), BLOCK), first_masked, a, second)
    return plain, masked


@jit
def tile_start(index, tiles, BLOCK: tl.constexpr):
    """The first position of tile ``index`` of a ``_loop_split`` list."""
    first_count, first_start, second_start = tiles[1], tiles[2], tiles[3]
    return tl.where(index < first_count, first_start + index * BLOCK, second_start + (index - first_count) * BLOCK)


@jit
def key_loop_bounds(pid_m, num_queries, num_keys, window, span, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr):  # fmt: skip
    """The plain and masked tiles of a query block's loop over key blocks (forward and dq). A sliding window (causal)
    starts the loop at the tile of the block's first query's first key, masks the tiles that the window's edge crosses
    and leaves the keys below it unvisited: O(window) tiles per block."""
    offset = num_keys - num_queries
    first_key = offset + pid_m * BLOCK_M  # the key position of the block's first query
    full_end = num_keys // BLOCK_N * BLOCK_N
    begin = 0
    if IS_CAUSAL:
        end = tl.minimum(num_keys, first_key + BLOCK_M)
        a = tl.minimum(full_end, first_key // BLOCK_N * BLOCK_N)  # below the diagonal: no self pair either
        b = end
        c = end
        if HAS_WINDOW:  # masked [begin, b), plain [b, c), masked [c, end)
            begin = tl.maximum(first_key - window + 1, 0) // BLOCK_N * BLOCK_N
            b = tl.maximum(tl.cdiv(tl.maximum(first_key + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, begin)
            b = tl.minimum(b, end)
            c = a
            a = begin
    else:
        end = num_keys
        a = tl.minimum(full_end, first_key // BLOCK_N * BLOCK_N)
        b = tl.maximum(a, tl.minimum(end, tl.cdiv(tl.minimum(first_key + BLOCK_M, num_keys), BLOCK_N) * BLOCK_N))
        c = full_end
    if HAS_KEY_MASK:
        a = begin
        b = end
        c = end
    return _loop_split(begin, a, b, c, end, span, BLOCK_N)


@jit
def query_loop_bounds(pid_n, num_queries, num_keys, window, span, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr):  # fmt: skip
    """The plain and masked tiles of a key block's loop over query blocks (dkdv); under a sliding window (causal) the
    loop ends after the last query whose window holds one of the block's keys."""
    offset = num_keys - num_queries
    first_query = pid_n * BLOCK_N - offset  # the query at the block's first key position (may be < 0)
    full_end = num_queries // BLOCK_M * BLOCK_M
    end = num_queries
    begin = 0
    if IS_CAUSAL:  # queries before the block's first key never see it
        begin = tl.maximum(first_query, 0) // BLOCK_M * BLOCK_M
        a = begin
        b = tl.minimum(full_end, tl.cdiv(tl.maximum(first_query + BLOCK_N, 0), BLOCK_M) * BLOCK_M)
        b = tl.maximum(b, begin)
        c = full_end
        if HAS_WINDOW:  # queries at key positions up to the block's last key + window - 1 see some of its keys
            end = tl.minimum(num_queries, tl.maximum(first_query + BLOCK_N + window - 1, 0))
            b = tl.minimum(b, end)
            c = tl.minimum(c, tl.maximum(first_query + window, 0) // BLOCK_M * BLOCK_M)
    else:
        a = tl.minimum(full_end, tl.maximum(first_query, 0) // BLOCK_M * BLOCK_M)
        band_end = tl.cdiv(tl.minimum(tl.maximum(first_query + BLOCK_N, 0), num_queries), BLOCK_M) * BLOCK_M
        b = tl.maximum(a, tl.minimum(num_queries, band_end))
        c = full_end
    if HAS_KEY_MASK:
        a = begin
        b = end
        c = end
    return _loop_split(begin, a, b, c, end, span, BLOCK_M)


@jit
def pass_block_start(pid, BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr):
    """The first position of the block of PASS_BLOCK positions (the first pass's fixed block) whose flags decide the
    pass of program ``pid`` of BLOCK positions: its own block, or an exact pass's smaller one's enclosing block
    (``KernelConfig.exact_block``)."""
    if PASS_BLOCK == BLOCK:
        return pid * BLOCK
    return pid // (PASS_BLOCK // BLOCK) * PASS_BLOCK


@jit
def forward_flagged(Flags, first, size, SPAN: tl.constexpr, FLAG_BLOCK: tl.constexpr):
    """Whether the forward flagged a block of FLAG_BLOCK positions that holds any of [first, first + SPAN) (below
    ``size``): a backward program's own flag, its block's queries (dq) or keys (dk/dv) against the forward's query
    blocks or key tiles."""
    positions = first + tl.arange(0, SPAN)
    return tl.max(tl.load(Flags + positions // FLAG_BLOCK, mask=positions < size, other=0)) != 0
