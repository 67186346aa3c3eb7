"""Fused p-Laplacian attention in Triton: FlashAttention-2-style forward and backward kernels.

Same maths and backward as ``plap_attention_tiled`` (see its docstring), with each tile in registers:

- ``_plap_fwd_kernel``: one program per (query block, batch * head); loops over key blocks with an
  online softmax (running max and sum in float32); the numerator accumulates exp(s - m) * P @ V, the
  denominator exp(s - m) alone. Saves the output, the row logsumexp and, for euler, 1 - rowsum(W_off).
- ``_plap_bwd_dkdv_kernel``: one program per (key block, batch * head); loops over query blocks for dk
  and the key-side part of dv.
- ``_plap_bwd_dq_kernel``: one program per (query block, batch * head); loops over key blocks for dq and
  adds the query-side part of dv (the distance terms of each query's own value) to the rows dkdv wrote.

P and every accumulation are float32. Matmuls of half-precision operands take them as they are (exact
products). No matmul with a float32 operand runs in plain TF32, whose inputs keep 10 mantissa bits: for
float32 inputs every matmul is tf32x3 (``FLOAT32_DOT``), v_x.v_y of D2 included; for half inputs the float32
operand is the distance gradient Gd of Gd V and Gd^T V_q (``_exact_dot``). Gd grows like 1 / (D2 + eps) and
its exact row and column sums cancel against those matmuls, so that a TF32 rounding of Gd (2^-11) would make
dV of coinciding values mostly noise. Masks: causal (bottom-right aligned) and key padding (a boolean mask
broadcastable to (B, 1, 1, Nk)); ``plap_attention`` routes other masks to the tiled backend. Lengths need
not be multiples of the blocks. No gradient for p (a fixed buffer).

What a GPU can run is decided before any launch, by ``triton_unsupported_reason``: the Triton version, the
compute capability, dtypes, head sizes per dtype and architecture (so that the tiles fit its shared memory),
mask shapes and element counts. ``tests/test_triton_compile.py`` compiles every configuration it admits for
each supported architecture, on CPU. A compile or launch failure that still happens is re-raised with the
configuration and a pointer to the tiled backend, never replaced silently.

``import triton`` sits in try/except so that this module imports without Triton (remote code scans the
imports). On CPU the kernels run under the Triton interpreter when TRITON_INTERPRET=1 is set before this
module is imported (tests do that).
"""

import math
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    jit = triton.jit
    constexpr = tl.constexpr
    TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
except ImportError:  # the kernels are then never launched: triton_unsupported_reason explains
    triton = tl = None
    TRITON_VERSION = None

    def jit(fn):
        return fn

    def constexpr(value):  # annotations and constants below; nothing is compiled without Triton
        return value


# Oldest Triton whose compiled kernels are checked (tests/test_triton_compile.py run with it).
MIN_TRITON_VERSION = (3, 2)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest opt-in shared memory per block (bytes) of the compute capabilities the kernels are compiled and
# checked for (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY_LIMIT = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448}
# Offsets inside one (batch, head) slab and program ids are int32; the slab bases are int64.
MAX_OFFSET = 2**31 - 1
# Precision of every matmul with float32 operands (see the module docstring).
FLOAT32_DOT = constexpr("tf32x3")
# Keeps the sign, the exponent and the 10 mantissa bits of TF32 of a float32.
TF32_MASK = constexpr(0xFFFFE000)
# The kernels multiply the weights A * P, cast to the inputs' dtype, with the values in half-precision matmuls.
# For p <= 3, P = (|v_x - v_y|^2 + eps)^((p - 2) / 2) is at most about the value distance itself; for larger p
# it can pass float16's largest value (65,504) with ordinary activations (at p = 4, distances above 256).
FLOAT16_MAX_P = 3.0
# Row max start: finite, so that rows with no allowed key so far give exp(-inf - MIN) = 0, never NaN.
MIN_SCORE = constexpr(-1.0e38)


class KernelConfig(NamedTuple):
    block_m: int  # query rows per tile
    block_n: int  # key columns per tile
    num_warps: int
    num_stages: int


class LaunchConfig(NamedTuple):
    """One KernelConfig per kernel: the forward and dq kernels loop over key blocks, dkdv over query blocks."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig

    def with_blocks(self, block_m, block_n):
        return LaunchConfig(*(config._replace(block_m=block_m, block_n=block_n) for config in self))


def _config(fwd, dkdv, dq):
    """A LaunchConfig from (block_m, block_n, num_warps, num_stages) per kernel."""
    return LaunchConfig(KernelConfig(*fwd), KernelConfig(*dkdv), KernelConfig(*dq))


# LaunchConfigs by GPU generation (compute capability major: 8, Ampere and Ada, one table that fits the
# 99 KB of sm_86 and sm_89; 9, Hopper), input kind and padded head size (the larger of BLOCK_D and BLOCK_DV).
# Each kernel holds its own block as the left operand of its matmuls and loops over blocks of the other
# side: the larger that loop's block, the more registers its right operands take in every warp. Chosen as
# the largest tiles whose compiled kernels spill no registers (or a few dozen bytes) and fit the shared
# memory, as tests/test_triton_compile.py prints them; GPU timings may refine them. Larger heads run tiled.
CONFIGS = {
    (8, "half"): {
        16: _config((128, 64, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2)),
        32: _config((128, 32, 8, 2), (16, 128, 8, 2), (128, 32, 8, 2)),
        64: _config((128, 32, 8, 2), (16, 128, 8, 2), (128, 16, 8, 2)),
        128: _config((64, 16, 4, 2), (16, 32, 4, 2), (32, 16, 4, 2)),
    },
    (9, "half"): {
        16: _config((128, 64, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2)),
        32: _config((128, 64, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2)),
        64: _config((128, 64, 8, 2), (16, 128, 8, 2), (128, 32, 8, 2)),
        128: _config((128, 32, 8, 2), (16, 128, 8, 2), (32, 16, 4, 2)),
    },
    (8, "float32"): {
        16: _config((128, 16, 8, 2), (16, 128, 8, 2), (128, 16, 8, 2)),
        32: _config((128, 16, 8, 2), (16, 128, 8, 2), (32, 16, 4, 2)),
        64: _config((32, 32, 4, 2), (16, 16, 4, 2), (32, 16, 4, 2)),
    },
    (9, "float32"): {
        16: _config((128, 16, 8, 2), (16, 128, 8, 2), (128, 16, 8, 2)),
        32: _config((128, 16, 8, 2), (16, 128, 8, 2), (64, 16, 4, 2)),
        64: _config((128, 16, 8, 2), (16, 32, 4, 2), (32, 16, 4, 2)),
    },
}
# Tile sizes under the interpreter (CPU), where warps and stages mean nothing.
INTERPRETER_CONFIG = _config((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2))


def padded_head_size(head_dim):
    """BLOCK_D of a head size: the next power of two, at least 16 (the smallest tl.dot operand)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _configs(dtype, capability):
    return CONFIGS[capability[0], "float32" if dtype == torch.float32 else "half"]


def launch_config(dtype, head_dim, value_dim, capability):
    """The LaunchConfig of these inputs on a GPU of this compute capability, or None where none fits."""
    if capability not in SHARED_MEMORY_LIMIT or dtype not in SUPPORTED_DTYPES:
        return None
    return _configs(dtype, capability).get(max(padded_head_size(head_dim), padded_head_size(value_dim)))


def triton_unsupported_reason(query, key=None, value=None, *, p=None, attn_mask=None, document_ids=None,
                              formulation="paper"):
    """None when the Triton kernels can run this input, else why not (a phrase for an error message).

    ``key`` and ``value`` default to ``query``'s shape and dtype; ``max_p`` is the largest p of the heads
    (None: not checked, as while torch.compile traces, where p's values cannot be read). Every limit is
    static (shapes, dtypes, p, the device's compute capability, the Triton version), so that ``auto`` can
    choose another backend.
    """
    key = query if key is None else key
    value = key if value is None else value
    max_p = max(p) if p else None
    if document_ids is not None:
        return "packed rows (document_ids) are not fused yet"
    if triton is None:
        return "triton is not installed (pip install triton)"
    if TRITON_VERSION < MIN_TRITON_VERSION:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON_VERSION))}"
    if query.device.type == "cuda":
        capability = torch.cuda.get_device_capability(query.device)
        reason = capability_reason(capability, query.dtype, query.shape[-1], value.shape[-1])
    elif query.device.type == "cpu" and INTERPRETED:
        reason = None  # the interpreter has no architecture limits
    else:
        reason = (
            f"the kernels need CUDA tensors, got {query.device.type} (CPU tensors run only under the Triton "
            "interpreter, TRITON_INTERPRET=1 set before import)"
        )
    return reason or _input_reason(query, key, value, attn_mask, max_p)


def capability_reason(capability, dtype, head_dim, value_dim):
    """None when a GPU of this compute capability has a checked configuration for these sizes, else why not."""
    if capability not in SHARED_MEMORY_LIMIT:
        known = ", ".join(f"{major}.{minor}" for major, minor in SHARED_MEMORY_LIMIT)
        return f"compute capability {capability[0]}.{capability[1]} is not one the kernels are checked for ({known})"
    if dtype in SUPPORTED_DTYPES and launch_config(dtype, head_dim, value_dim, capability) is None:
        largest = max(_configs(dtype, capability))
        return f"head sizes {head_dim} and {value_dim} in {dtype}: the kernels' tiles fit {largest} at most"
    return None


def _input_reason(query, key, value, attn_mask, max_p):
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype} is not one of {SUPPORTED_DTYPES}"
    if query.dtype == torch.float16 and max_p is not None and max_p > FLOAT16_MAX_P:
        return (f"float16 with p = {max_p:g}: above p = {FLOAT16_MAX_P:g} the weights (|v_x - v_y|^2 + eps)^((p - 2)"
                " / 2) can pass float16's largest value in the kernels' half-precision matmuls (use bfloat16)")
    if not query.dtype == key.dtype == value.dtype:
        return f"query, key and value dtypes differ ({query.dtype}, {key.dtype}, {value.dtype})"
    if not query.device == key.device == value.device:
        return f"query, key and value are on different devices ({query.device}, {key.device}, {value.device})"
    if attn_mask is not None and _key_padding_shape(attn_mask) is None:
        return f"only key-padding masks broadcastable as (B, 1, 1, Nk) are fused; got {tuple(attn_mask.shape)}"
    if attn_mask is not None and attn_mask.device != query.device:
        return f"the mask is on {attn_mask.device}, the inputs on {query.device}"
    # Outputs and gradients are contiguous: one (batch, head) slab of the largest holds Nk * max(d, dv).
    extents = dict(query=_slab_extent(query), key=_slab_extent(key), value=_slab_extent(value),
                   gradients=key.shape[2] * max(query.shape[-1], value.shape[-1]) - 1)  # fmt: skip
    for name, extent in extents.items():
        if extent > MAX_OFFSET:
            return f"the {name} of one (batch, head) span more than 2^31 elements: int32 offsets would overflow"
    programs = query.shape[0] * query.shape[1] * key.shape[2]  # above the programs of any grid (tiles of 16+)
    if programs > MAX_OFFSET:
        return f"B * H * Nk = {programs} is above 2^31: the grid would overflow"
    return None


def _slab_extent(tensor):
    """Largest element offset inside one (batch, head) slab of a (B, H, N, d) tensor."""
    return sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape[2:], tensor.stride()[2:]))


def _key_padding_shape(attn_mask):
    """(B or 1, Nk or 1) when attn_mask is a key-padding mask, else None."""
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)  # (B|1, H|1, Nq|1, Nk|1)
    return (shape[0], shape[3]) if shape[1] == 1 and shape[2] == 1 else None


@jit
def _program_ids(num_rows, BLOCK: constexpr):
    """(row block, batch * head) of this program. The grid is 1-D (CUDA caps axes 1 and 2 at 65535);
    the row blocks of one head are adjacent, so that they share its keys and values in L2."""
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(num_rows, BLOCK)
    return pid % num_blocks, pid // num_blocks


@jit
def _slab(ptr, batch, head, stride_b, stride_h):
    """Pointer to the (batch, head) slab of a (B, H, ...) tensor; int64, as B * H * N * d may pass 2^31."""
    return ptr + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h


@jit
def _tile_ptrs(ptr, rows, cols, stride_row, stride_col):
    return ptr + rows[:, None] * stride_row + cols[None, :] * stride_col


@jit
def _tile_mask(rows, num_rows, cols, num_cols):
    return (rows[:, None] < num_rows) & (cols[None, :] < num_cols)


@jit
def _load_tile(ptr, rows, num_rows, stride_row, cols, num_cols, stride_col):
    """(len(rows), len(cols)) tile of a row-major matrix view; zeros outside (num_rows, num_cols)."""
    return tl.load(
        _tile_ptrs(ptr, rows, cols, stride_row, stride_col), mask=_tile_mask(rows, num_rows, cols, num_cols), other=0.0
    )


@jit
def _squared_norms(tile):
    return tl.sum(tile.to(tl.float32) * tile.to(tl.float32), 1)


@jit
def _exact_dot(a, b, acc):
    """acc + a @ b to float32 accuracy for a float32 ``a`` (a distance gradient). A half-precision ``b`` is
    exact in TF32, so ``a`` alone is split into its TF32 part and the rest: two TF32 matmuls, not tf32x3's three."""
    if b.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision=FLOAT32_DOT)
    else:
        b = b.to(tl.float32)
        a_high = (a.to(tl.uint32, bitcast=True) & TF32_MASK).to(tl.float32, bitcast=True)
        acc = tl.dot(a_high, b, acc, input_precision="tf32")
        acc = tl.dot(a - a_high, b, acc, input_precision="tf32")
    return acc


# Tiles pair queries with keys. The forward and dq kernels hold a query block and hold its tiles as
# (queries, keys), QUERY_AXIS = 0; dkdv holds a key block and works on (keys, queries) tiles, QUERY_AXIS = 1,
# so that each kernel's fixed block is the left operand of its matmuls: split over the warps, not repeated
# in every warp as a right operand is.


@jit
def _per_query(vector, QUERY_AXIS: constexpr):
    """A vector over the queries of a tile, broadcastable against the tile."""
    return tl.expand_dims(vector, 1 - QUERY_AXIS)


@jit
def _per_key(vector, QUERY_AXIS: constexpr):
    return tl.expand_dims(vector, QUERY_AXIS)


@jit
def _pair_dot(query_side, key_side, QUERY_AXIS: constexpr):
    """The tile of dot products of query-side rows (M, d) with key-side rows (N, d)."""
    if QUERY_AXIS == 0:
        tile = tl.dot(query_side, tl.trans(key_side), input_precision=FLOAT32_DOT)
    else:
        tile = tl.dot(key_side, tl.trans(query_side), input_precision=FLOAT32_DOT)
    return tile


@jit
def _allowed(rows, cols, num_queries, num_keys, key_keep_row, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr,
             QUERY_AXIS: constexpr):  # fmt: skip
    """Boolean tile: query rows may attend to key cols (in range, causal, not padding)."""
    query_pos = _per_query(rows, QUERY_AXIS)
    key_pos = _per_key(cols, QUERY_AXIS)
    allowed = (query_pos < num_queries) & (key_pos < num_keys)
    if IS_CAUSAL:
        allowed = allowed & (key_pos <= query_pos + (num_keys - num_queries))
    if HAS_KEY_MASK:
        keep = tl.load(key_keep_row + cols, mask=cols < num_keys, other=0)
        allowed = allowed & (_per_key(keep, QUERY_AXIS) != 0)
    return allowed


@jit
def _plap_weight(v_query, sq_query, values, sq_keys, rows, cols, offset, exponent, eps, QUERY_AXIS: constexpr):
    """D2 + eps (self pairs exactly eps), P = (D2 + eps) ** exponent, and the self-pair mask, all tiles."""
    cross = _pair_dot(v_query, values, QUERY_AXIS)
    dist = tl.maximum(_per_query(sq_query, QUERY_AXIS) + _per_key(sq_keys, QUERY_AXIS) - 2 * cross, 0.0)
    is_self = _per_key(cols, QUERY_AXIS) == _per_query(rows, QUERY_AXIS) + offset
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
    BLOCK_M: constexpr, BLOCK_N: constexpr, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, EULER: constexpr,
):  # fmt: skip
    pid_m, pid_bh = _program_ids(num_queries, BLOCK_M)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    offset = num_keys - num_queries  # query i is the token at key position offset + i
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    Q = _slab(Q, batch, head, stride_qb, stride_qh)
    K = _slab(K, batch, head, stride_kb, stride_kh)
    V = _slab(V, batch, head, stride_vb, stride_vh)
    Out = _slab(Out, batch, head, stride_ob, stride_oh)
    stats = pid_bh.to(tl.int64) * num_queries  # Lse and OwnWeight are (B * H, Nq), contiguous
    key_keep_row = KeyKeep + batch.to(tl.int64) * stride_keep_b
    q = _load_tile(Q, rows, num_queries, stride_qn, dims, HEAD_DIM, stride_qd)
    v_query = _load_tile(V, rows + offset, num_keys, stride_vn, vdims, VALUE_DIM, stride_vd)
    sq_query = _squared_norms(v_query)
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
        k = _load_tile(K, cols, num_keys, stride_kn, dims, HEAD_DIM, stride_kd)
        values = _load_tile(V, cols, num_keys, stride_vn, vdims, VALUE_DIM, stride_vd)
        scores = _pair_dot(q, k, 0) * scale
        allowed = _allowed(rows, cols, num_queries, num_keys, key_keep_row, IS_CAUSAL, HAS_KEY_MASK, 0)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        rescale = tl.exp(row_max - new_max)
        expo = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(expo, 1)
        dist_eps, plap, is_self = _plap_weight(
            v_query, sq_query, values, _squared_norms(values), rows, cols, offset, exponent, eps, 0
        )
        weights = expo * plap
        if EULER:
            weights = tl.where(is_self, 0.0, weights)
            off_sum = off_sum * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=FLOAT32_DOT)
        row_max = new_max

    valid = row_sum > 0  # at least one allowed key; fully masked rows output zeros
    inv_sum = 1.0 / tl.where(valid, row_sum, 1.0)
    out = acc * inv_sum[:, None]
    row_in = rows < num_queries
    if EULER:
        own_weight = tl.where(valid, 1.0 - off_sum * inv_sum, 0.0)  # u_x = v_x (1 - rowsum W_off) + W_off V
        out += own_weight[:, None] * v_query.to(tl.float32)
        tl.store(OwnWeight + stats + rows, own_weight, mask=row_in)
    tl.store(_tile_ptrs(Out, rows, vdims, stride_on, stride_od), out.to(Out.dtype.element_ty),
             mask=_tile_mask(rows, num_queries, vdims, VALUE_DIM))  # fmt: skip
    # +inf on fully masked rows makes the backward's exp(s - lse) exactly 0 there.
    lse = row_max + tl.log(tl.where(valid, row_sum, 1.0))
    tl.store(Lse + stats + rows, tl.where(valid, lse, float("inf")), mask=row_in)


@jit
def _tile_grads(
    q, k, v_query, values, sq_query, sq_keys, grad_out, lse, delta, own_dot, rows, cols, key_keep_row,
    num_queries, num_keys, scale, exponent, eps,
    IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, EULER: constexpr, QUERY_AXIS: constexpr,
):  # fmt: skip
    """Recompute one tile: W (W_off for euler), dS and 2 dL/dD2 (0 on self pairs)."""
    scores = _pair_dot(q, k, QUERY_AXIS) * scale
    allowed = _allowed(rows, cols, num_queries, num_keys, key_keep_row, IS_CAUSAL, HAS_KEY_MASK, QUERY_AXIS)
    attn = tl.exp(tl.where(allowed, scores, float("-inf")) - _per_query(lse, QUERY_AXIS))
    dist_eps, plap, is_self = _plap_weight(
        v_query, sq_query, values, sq_keys, rows, cols, num_keys - num_queries, exponent, eps, QUERY_AXIS
    )
    weights = attn * plap
    grad_w = _pair_dot(grad_out, values, QUERY_AXIS)  # G = dU V^T
    if EULER:
        weights = tl.where(is_self, 0.0, weights)
        grad_w -= _per_query(own_dot, QUERY_AXIS)  # dW = G - dU.v_x
    weighted = weights * grad_w
    grad_scores = weighted - attn * _per_query(delta, QUERY_AXIS)
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
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    num_heads, num_queries, num_keys, scale, eps,
    HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
    BLOCK_M: constexpr, BLOCK_N: constexpr, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, EULER: constexpr,
):  # fmt: skip
    pid_n, pid_bh = _program_ids(num_keys, BLOCK_N)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    offset = num_keys - num_queries
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    Q = _slab(Q, batch, head, stride_qb, stride_qh)
    K = _slab(K, batch, head, stride_kb, stride_kh)
    V = _slab(V, batch, head, stride_vb, stride_vh)
    GradOut = _slab(GradOut, batch, head, stride_gb, stride_gh)
    GradK = _slab(GradK, batch, head, stride_dkb, stride_dkh)
    GradV = _slab(GradV, batch, head, stride_dvb, stride_dvh)
    stats = pid_bh.to(tl.int64) * num_queries
    key_keep_row = KeyKeep + batch.to(tl.int64) * stride_keep_b
    k = _load_tile(K, cols, num_keys, stride_kn, dims, HEAD_DIM, stride_kd)
    values = _load_tile(V, cols, num_keys, stride_vn, vdims, VALUE_DIM, stride_vd)
    sq_keys = _squared_norms(values)
    exponent = tl.load(Exponent + head)

    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    start_m = 0
    if IS_CAUSAL:  # queries before key position pid_n * BLOCK_N - offset never see this block
        start_m = tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
    for start in range(start_m, num_queries, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_in = rows < num_queries
        q = _load_tile(Q, rows, num_queries, stride_qn, dims, HEAD_DIM, stride_qd)
        v_query = _load_tile(V, rows + offset, num_keys, stride_vn, vdims, VALUE_DIM, stride_vd)
        grad_out = _load_tile(GradOut, rows, num_queries, stride_gn, vdims, VALUE_DIM, stride_gd)
        lse = tl.load(Lse + stats + rows, mask=row_in, other=float("inf"))
        delta = tl.load(Delta + stats + rows, mask=row_in, other=0.0)
        own_dot = tl.load(OwnDot + stats + rows, mask=row_in, other=0.0)
        # (keys, queries) tiles
        weights, grad_scores, grad_dist = _tile_grads(
            q, k, v_query, values, _squared_norms(v_query), sq_keys, grad_out, lse, delta, own_dot, rows, cols,
            key_keep_row, num_queries, num_keys, scale, exponent, eps, IS_CAUSAL, HAS_KEY_MASK, EULER, 1,
        )  # fmt: skip
        grad_v += tl.dot(weights.to(grad_out.dtype), grad_out, input_precision=FLOAT32_DOT)
        grad_k += tl.dot(grad_scores.to(q.dtype), q, input_precision=FLOAT32_DOT)
        # Key side of the distances: dv_y += 2 sum_x dL/dD2 (v_y - v_x).
        grad_v += tl.sum(grad_dist, 1)[:, None] * values.to(tl.float32)
        grad_v = _exact_dot(-grad_dist, v_query, grad_v)

    tl.store(_tile_ptrs(GradK, cols, dims, stride_dkn, stride_dkd), grad_k * scale,
             mask=_tile_mask(cols, num_keys, dims, HEAD_DIM))  # fmt: skip
    tl.store(_tile_ptrs(GradV, cols, vdims, stride_dvn, stride_dvd), grad_v,
             mask=_tile_mask(cols, num_keys, vdims, VALUE_DIM))  # fmt: skip


@jit
def _plap_bwd_dq_kernel(
    Q, K, V, GradOut, Lse, Delta, OwnDot, OwnWeight, Exponent, KeyKeep, GradQ, GradV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_keep_b,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    num_heads, num_queries, num_keys, scale, eps,
    HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
    BLOCK_M: constexpr, BLOCK_N: constexpr, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, EULER: constexpr,
):  # fmt: skip
    pid_m, pid_bh = _program_ids(num_queries, BLOCK_M)
    batch, head = pid_bh // num_heads, pid_bh % num_heads
    offset = num_keys - num_queries
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    Q = _slab(Q, batch, head, stride_qb, stride_qh)
    K = _slab(K, batch, head, stride_kb, stride_kh)
    V = _slab(V, batch, head, stride_vb, stride_vh)
    GradOut = _slab(GradOut, batch, head, stride_gb, stride_gh)
    GradQ = _slab(GradQ, batch, head, stride_dqb, stride_dqh)
    GradV = _slab(GradV, batch, head, stride_dvb, stride_dvh)
    stats = pid_bh.to(tl.int64) * num_queries
    key_keep_row = KeyKeep + batch.to(tl.int64) * stride_keep_b
    row_in = rows < num_queries
    q = _load_tile(Q, rows, num_queries, stride_qn, dims, HEAD_DIM, stride_qd)
    v_query = _load_tile(V, rows + offset, num_keys, stride_vn, vdims, VALUE_DIM, stride_vd)
    grad_out = _load_tile(GradOut, rows, num_queries, stride_gn, vdims, VALUE_DIM, stride_gd)
    lse = tl.load(Lse + stats + rows, mask=row_in, other=float("inf"))
    delta = tl.load(Delta + stats + rows, mask=row_in, other=0.0)
    own_dot = tl.load(OwnDot + stats + rows, mask=row_in, other=0.0)
    sq_query = _squared_norms(v_query)
    exponent = tl.load(Exponent + head)

    grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    grad_v_own = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # query side of the distances
    grad_dist_rowsum = tl.zeros([BLOCK_M], tl.float32)
    end = num_keys
    if IS_CAUSAL:
        end = tl.minimum(num_keys, offset + (pid_m + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_tile(K, cols, num_keys, stride_kn, dims, HEAD_DIM, stride_kd)
        values = _load_tile(V, cols, num_keys, stride_vn, vdims, VALUE_DIM, stride_vd)
        weights, grad_scores, grad_dist = _tile_grads(
            q, k, v_query, values, sq_query, _squared_norms(values), grad_out, lse, delta, own_dot, rows, cols,
            key_keep_row, num_queries, num_keys, scale, exponent, eps, IS_CAUSAL, HAS_KEY_MASK, EULER, 0,
        )  # fmt: skip
        grad_q += tl.dot(grad_scores.to(k.dtype), k, input_precision=FLOAT32_DOT)
        grad_v_own = _exact_dot(-grad_dist, values, grad_v_own)
        grad_dist_rowsum += tl.sum(grad_dist, 1)

    tl.store(_tile_ptrs(GradQ, rows, dims, stride_dqn, stride_dqd), grad_q * scale,
             mask=_tile_mask(rows, num_queries, dims, HEAD_DIM))  # fmt: skip
    # dv_x += 2 sum_y dL/dD2 (v_x - v_y), plus for euler the direct dU_x (1 - rowsum W_off).
    grad_v_own += grad_dist_rowsum[:, None] * v_query.to(tl.float32)
    if EULER:
        own_weight = tl.load(OwnWeight + stats + rows, mask=row_in, other=0.0)
        grad_v_own += own_weight[:, None] * grad_out.to(tl.float32)
    # The dkdv kernel, launched before, wrote these rows; each program here owns its own rows.
    grad_v_ptrs = _tile_ptrs(GradV, rows + offset, vdims, stride_dvn, stride_dvd)
    vmask = _tile_mask(rows, num_queries, vdims, VALUE_DIM)
    tl.store(grad_v_ptrs, tl.load(grad_v_ptrs, mask=vmask, other=0.0) + grad_v_own, mask=vmask)


# Under the interpreter triton.jit returns interpreted functions instead of JITFunctions.
INTERPRETED = triton is not None and not isinstance(_plap_fwd_kernel, triton.runtime.JITFunction)


class Launch(NamedTuple):
    """One kernel launch: ``kernel[grid](*args, **meta)``. Built by the same functions for a real launch
    and for tests that compile the kernels ahead of time."""

    kernel: object
    grid: tuple
    args: tuple
    meta: dict


def _meta(query, value, config, is_causal, has_key_mask, euler):
    """Compile-time arguments of a kernel with this KernelConfig."""
    return dict(
        HEAD_DIM=query.shape[-1],
        VALUE_DIM=value.shape[-1],
        BLOCK_D=padded_head_size(query.shape[-1]),
        BLOCK_DV=padded_head_size(value.shape[-1]),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        IS_CAUSAL=is_causal,
        HAS_KEY_MASK=has_key_mask,
        EULER=euler,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def forward_launch(query, key, value, out, lse, own_weight, exponent, key_keep, is_causal, eps, euler, config):
    """The forward launch; ``key_keep`` is the (B, Nk) int8 padding mask or None."""
    batch, heads, num_queries, _ = query.shape
    has_key_mask = key_keep is not None
    key_keep = key_keep if has_key_mask else exponent  # any pointer; never read without the mask
    args = (
        query, key, value, out, lse, own_weight, exponent, key_keep,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(), key_keep.stride(0),
        heads, num_queries, key.shape[2], 1 / math.sqrt(query.shape[-1]), eps,
    )  # fmt: skip
    grid = (triton.cdiv(num_queries, config.fwd.block_m) * batch * heads,)
    return Launch(_plap_fwd_kernel, grid, args, _meta(query, value, config.fwd, is_causal, has_key_mask, euler))


def backward_launches(
    query, key, value, grad_out, lse, delta, own_dot, own_weight, exponent, key_keep, grad_q, grad_k, grad_v,
    is_causal, eps, euler, config,
):  # fmt: skip
    """The dk/dv launch, then the dq launch (which adds to the dv rows of each query's own value)."""
    batch, heads, num_queries, _ = query.shape
    num_keys = key.shape[2]
    has_key_mask = key_keep is not None
    key_keep = key_keep if has_key_mask else exponent
    inputs = (*query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), key_keep.stride(0))
    sizes = (heads, num_queries, num_keys, 1 / math.sqrt(query.shape[-1]), eps)
    dkdv = Launch(
        _plap_bwd_dkdv_kernel,
        (triton.cdiv(num_keys, config.dkdv.block_n) * batch * heads,),
        (query, key, value, grad_out, lse, delta, own_dot, exponent, key_keep, grad_k, grad_v,
         *inputs, *grad_k.stride(), *grad_v.stride(), *sizes),
        _meta(query, value, config.dkdv, is_causal, has_key_mask, euler),
    )  # fmt: skip
    dq = Launch(
        _plap_bwd_dq_kernel,
        (triton.cdiv(num_queries, config.dq.block_m) * batch * heads,),
        (query, key, value, grad_out, lse, delta, own_dot, own_weight, exponent, key_keep, grad_q, grad_v,
         *inputs, *grad_q.stride(), *grad_v.stride(), *sizes),
        _meta(query, value, config.dq, is_causal, has_key_mask, euler),
    )  # fmt: skip
    return dkdv, dq


def _run(launch, query, value):
    """Launch; a failure (compilation, resources, driver) is re-raised with what a bug report needs."""
    try:
        launch.kernel[launch.grid](*launch.args, **launch.meta)
    except Exception as error:
        if query.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(query.device)
            device = f"{torch.cuda.get_device_name(query.device)} (sm_{major}{minor})"
        else:
            device = "the Triton interpreter"
        raise RuntimeError(
            f"the Triton backend failed in {launch.kernel.__name__} for {query.dtype}, head sizes "
            f"{query.shape[-1]}/{value.shape[-1]}, on {device}, with triton {triton.__version__}: "
            f"{type(error).__name__}: {error}. plap_backend='tiled' runs the same maths without Triton."
        ) from error


class _PlapAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, exponent, key_keep, is_causal, eps, euler, config):
        batch, heads, num_queries, _ = query.shape
        out = query.new_empty(batch, heads, num_queries, value.shape[-1])  # (B, H, Nq, dv)
        lse = torch.empty(batch, heads, num_queries, device=query.device, dtype=torch.float32)
        own_weight = torch.empty_like(lse) if euler else lse  # written by euler only
        launch = forward_launch(
            query, key, value, out, lse, own_weight, exponent, key_keep, is_causal, eps, euler, config
        )
        _run(launch, query, value)
        ctx.save_for_backward(query, key, value, out, lse, own_weight, exponent, key_keep)
        ctx.args = (is_causal, eps, euler, config)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, own_weight, exponent, key_keep = ctx.saved_tensors
        is_causal, eps, euler, config = ctx.args
        num_queries, num_keys = query.shape[2], key.shape[2]
        if _slab_extent(grad_out) > MAX_OFFSET:  # only an exotic layout could; contiguous fits
            grad_out = grad_out.contiguous()
        grad_f32 = grad_out.float()
        # FlashAttention's D = rowsum(dU * U); euler subtracts the own-value part dU . v_x.
        own_dot = (grad_f32 * value[:, :, num_keys - num_queries :].float()).sum(-1)  # (B, H, Nq)
        delta = (grad_f32 * out.float()).sum(-1) - (own_dot if euler else 0)
        grad_q = torch.empty(query.shape, device=query.device, dtype=torch.float32)
        grad_k = torch.empty(key.shape, device=query.device, dtype=torch.float32)
        grad_v = torch.empty(value.shape, device=query.device, dtype=torch.float32)
        for launch in backward_launches(
            query, key, value, grad_out, lse, delta, own_dot, own_weight, exponent, key_keep, grad_q, grad_k,
            grad_v, is_causal, eps, euler, config,
        ):  # fmt: skip
            _run(launch, query, value)
        grads = (grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype))
        return *grads, None, None, None, None, None, None


def plap_attention_triton(
    query, key, value, *, p, attn_mask=None, is_causal=False, document_ids=None, eps=1e-6, formulation="paper",
    blocks=None, config=None,
):
    """p-Laplacian attention with fused kernels; arguments as ``plap_attention`` (inputs checked there).

    ``p`` is an (H,) tensor and gets no gradient; its float16 limit (``FLOAT16_MAX_P``) is checked by
    ``plap_attention``'s dispatcher, which keeps p's host copy. ``attn_mask`` must be a key-padding mask (see
    ``triton_unsupported_reason``). ``config`` (a LaunchConfig) overrides the one of the GPU, and ``blocks`` =
    (BLOCK_M, BLOCK_N) the tile sizes of all three kernels (tests cross tile borders with them).
    """
    reason = triton_unsupported_reason(query, key, value, p=p, attn_mask=attn_mask, document_ids=document_ids)
    if reason is not None:
        raise ValueError(f"the Triton backend cannot run this input: {reason}")
    if config is None and query.device.type == "cuda":
        capability = torch.cuda.get_device_capability(query.device)
        config = launch_config(query.dtype, query.shape[-1], value.shape[-1], capability)
    elif config is None:
        config = INTERPRETER_CONFIG
    if blocks is not None:
        config = config.with_blocks(*blocks)
    key_keep = None
    if attn_mask is not None:
        batch, num_keys = query.shape[0], key.shape[2]
        key_keep = attn_mask.reshape(_key_padding_shape(attn_mask)).expand(batch, num_keys)
        key_keep = key_keep.to(torch.int8).contiguous()  # (B, Nk)
    exponent = (torch.tensor(p, dtype=torch.float32, device=query.device) - 2) / 2  # (H,)
    return _PlapAttentionTriton.apply(
        query, key, value, exponent, key_keep, is_causal, eps, formulation == "euler", config
    )
