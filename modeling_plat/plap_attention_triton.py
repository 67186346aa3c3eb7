"""Fused p-Laplacian attention in Triton: FlashAttention-2-style forward and backward kernels.

Same maths and backward as ``plap_attention_tiled`` (see its docstring), with each tile in registers:

- ``_plap_fwd_kernel``: one program per (query block, batch * head); loops over key blocks with an
  online softmax (running max and sum in float32); the numerator accumulates exp(s - m) * P @ V, the
  denominator exp(s - m) alone. Saves the output, the row logsumexp (base 2) and, for euler,
  1 - rowsum(W_off).
- ``_plap_bwd_dq_kernel``: one program per (query block, batch * head), launched first; computes its queries'
  FlashAttention D = rowsum(dU * U) for the dkdv kernel, loops over key blocks for dq and the query-side part of dv
  (the distance terms of each query's own value, kept in float32).
- ``_plap_bwd_dkdv_kernel``: one program per (key block, batch * head); loops over query blocks for dk
  and the key-side part of dv, adds the query side and stores dv once in the values' dtype.
- Each of the three runs twice over its grid (``EXACT``): a first pass with the distances' expansion alone, then an
  exact pass over the blocks that have close pairs (below). The forward's first pass finds them: a block that meets
  one stores only a flag. Its exact pass redoes those blocks and flags each key tile in which it met one, so that the
  backward's passes split their blocks by the forward's flags (dq by query, dk/dv by key) without a test of their own
  in the first pass. The close pairs' direct differences take code and registers that would cut the blocks per SM
  to one. Calls of at most ``ONE_PASS_PAIRS`` pairs run the exact pass alone, every block flagged: one launch per
  kernel, where the GPU would wait for the host's launches rather than for the kernels.
- The values' squared norms, float32, before the forward: two ATen operations (a norm reduction that reads the
  values once, and its square), whose host time is a fraction of a Triton launch's.

Built against the static cost model of ``benchmarks/gpu_static_cost.py`` (instructions per score of the main
loop): scores in log2 units (one exp2 each, log2(e) / sqrt(d) folded into the scale); D2 + eps from the
values' squared norms, computed once per call; P = (D2 + eps) ** ((p - 2) / 2) with the hardware's
approximate special functions (relative error ~2^-22), p = 1.5 and 2.5 as rsqrt/sqrt chains, any other p as
exp2(e * log2(x)) (one launch for up to 32 consecutive heads with at most two values of p: each program reads its
head's p from a bit mask, and the power's class is a compile-time constant of each of the two branches); the
backward's 1 / (D2 + eps) from the same rsqrt, or exp2(-log2(x)). Each loop runs in two parts: plain tiles,
whose pairs are all allowed and off the diagonal, with no mask and no self-pair test, then the few masked
tiles (the diagonal band, the last partial tile, every tile under key padding).

P and every accumulation are float32. Matmuls of half-precision operands take them as they are (exact
products). No matmul with a float32 operand runs in plain TF32, whose inputs keep 10 mantissa bits: for
float32 inputs every matmul is tf32x3 (``FLOAT32_DOT``), v_x.v_y of D2 included; for half inputs the float32
operand is the distance gradient Gd of Gd V and Gd^T V_q (``_exact_dot``: against bfloat16 values, three bfloat16
parts in the exact passes and Gd rounded to bfloat16 in the first passes, whose pairs are not close, each with the
row sums of the same parts; two TF32 parts against float16). Gd grows like 1 / (D2 + eps) and its row and column
sums cancel against those matmuls, so that a TF32 rounding of Gd (2^-11) against float32 sums would make dV of
coinciding values mostly noise. Masks: causal (bottom-right aligned) and key padding
(a boolean mask broadcastable to (B, 1, 1, Nk)); ``plap_attention`` routes other masks to the tiled backend. Packed rows
(``document_ids``, Nq == Nk) are varlen: each fixed block's loop visits only the span of positions its
documents cover, and a plain tile compares document ids only when its tokens are not all of one document
(a test per tile, none per score). Lengths need not be multiples of the blocks. The wrapper makes q, k and v
contiguous once, so that the kernels compute offsets from the shapes. No gradient for p (static per head).

What a GPU can run is decided before any launch, by ``triton_unsupported_reason``: the Triton version, the
compute capability, dtypes, head sizes per dtype and architecture (so that the tiles fit its shared memory),
mask shapes and element counts. ``tests/attention/test_triton_compile.py`` compiles every configuration it admits for
each supported architecture, on CPU. A compile or launch failure that still happens is re-raised with the
configuration and a pointer to the tiled backend, never replaced silently.

``import triton`` sits in try/except so that this module imports without Triton (remote code scans the
imports). On CPU the kernels run under the Triton interpreter when TRITON_INTERPRET=1 is set before this
module is imported (tests do that).
"""

import functools
import math
from typing import NamedTuple

import torch

from .custom_ops import FusedOp, op_name
from .plap_attention_reference import CLOSE_PAIR, COINCIDING

try:
    import triton
    import triton.language as tl

    jit = triton.jit
    constexpr = tl.constexpr
    TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
except ImportError:  # the kernels are then never launched: triton_unsupported_reason explains
    triton = tl = None
    TRITON_VERSION = None

    def jit(fn=None, **options):
        return fn if fn is not None else (lambda function: function)

    def constexpr(value):  # annotations and constants below; nothing is compiled without Triton
        return value


# Oldest Triton whose compiled kernels are checked (tests/attention/test_triton_compile.py run with it).
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
# Keeps the sign, the exponent and the 7 mantissa bits of a bfloat16.
BFLOAT16_MASK = constexpr(0xFFFF0000)
# The kernels multiply the weights A * P, cast to the inputs' dtype, with the values in half-precision matmuls.
# For p <= 3, P = (|v_x - v_y|^2 + eps)^((p - 2) / 2) is at most about the value distance itself; for larger p
# it can pass float16's largest value (65,504) with ordinary activations (at p = 4, distances above 256).
FLOAT16_MAX_P = 3.0
# exp(x) = exp2(x * LOG2_E): the kernels' scores are in log2 units, log2(e) / sqrt(d) folded into one scale.
LOG2_E = 1.4426950408889634
LN_2 = constexpr(math.log(2))
FORMULATIONS = ("paper", "euler")
# Row max start: finite, so that rows with no allowed key so far give exp(-inf - MIN) = 0, never NaN.
MIN_SCORE = constexpr(-1.0e38)
# Columns of the tile of ones against which the distance gradient's bfloat16 parts give their row sums (a matmul's
# smallest width).
SUM_COLUMNS = constexpr(16)
# The reference's rules for close and coinciding pairs, as constants a compiled kernel can read.
CLOSE_PAIR = constexpr(CLOSE_PAIR)
COINCIDING = constexpr(COINCIDING)


class KernelConfig(NamedTuple):
    block_m: int  # query rows per tile
    block_n: int  # key columns per tile
    num_warps: int
    num_stages: int
    # ptxas's register cap per thread (0: its own choice), so that more blocks fit an SM: for first passes without key
    # padding or packed documents (whose branches, like the exact passes, hold more and would spill in the loop).
    max_registers: int = 0
    # The backward's row sums of the distance gradient against bfloat16 values: 1 from a matmul of its parts against
    # ones (``_exact_dot``), 0 summed in each thread, where the parts' second matmul layout spills (sm_80, d = 128).
    sums_by_matmul: int = 1


class LaunchConfig(NamedTuple):
    """One KernelConfig per kernel: the forward and dq kernels loop over key blocks, dkdv over query blocks."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig

    def with_blocks(self, block_m, block_n):
        return LaunchConfig(*(config._replace(block_m=block_m, block_n=block_n) for config in self))


def _config(fwd, dkdv, dq):
    """A LaunchConfig from (block_m, block_n, num_warps, num_stages[, max_registers[, sums_by_matmul]]) per kernel."""
    return LaunchConfig(KernelConfig(*fwd), KernelConfig(*dkdv), KernelConfig(*dq))


# LaunchConfigs by GPU generation (8: Ampere and Ada, sized for sm_86/sm_89's 99 KB; 9: Hopper), input kind and
# padded head size: `pytest tests/attention/test_triton_compile.py -s` and `python benchmarks/gpu_static_cost.py`
# re-derive them (how: docs/performance.md, "Launch configurations"). Larger heads run tiled.
CONFIGS = {
    (8, "half"): {
        16: _config((128, 64, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2)),
        32: _config((128, 32, 8, 2), (16, 128, 8, 2), (128, 32, 8, 2)),
        64: _config((128, 32, 8, 2), (16, 128, 8, 2), (128, 16, 8, 2)),
        128: _config((128, 32, 8, 2), (16, 32, 4, 2, 0, 0), (32, 32, 4, 2, 0, 0)),
    },
    (9, "half"): {
        16: _config((128, 64, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2)),
        32: _config((128, 64, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2)),
        64: _config((64, 64, 4, 2, 168), (32, 64, 4, 2, 168), (64, 32, 4, 2, 168)),
        128: _config((64, 32, 4, 2, 168), (32, 64, 4, 2), (64, 32, 4, 2)),
    },
    (8, "float32"): {
        16: _config((128, 16, 8, 2), (16, 128, 8, 2), (128, 16, 8, 2)),
        32: _config((128, 16, 8, 2), (16, 128, 8, 2), (32, 16, 4, 2)),
        64: _config((32, 32, 4, 2), (16, 16, 4, 2), (32, 16, 4, 2)),
    },
    (9, "float32"): {
        16: _config((128, 16, 8, 2), (16, 128, 8, 2), (128, 16, 8, 2)),
        32: _config((128, 16, 8, 2), (16, 128, 8, 2), (64, 16, 4, 2)),
        64: _config((128, 16, 8, 2), (32, 16, 4, 2), (32, 16, 4, 2)),
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


def triton_unsupported_reason(query, key=None, value=None, *, p, attn_mask=None, document_ids=None,
                              formulation="paper", device_type=None, capability=None):  # fmt: skip
    """None when the Triton kernels can run this input, else why not (a phrase for an error message).

    ``key`` and ``value`` default to ``query``'s shape and dtype. ``p`` is the heads' p, a tuple of floats
    (its largest decides float16's limit). Every limit is static (shapes, dtypes, p, the device's compute
    capability, the Triton version), so that ``auto`` can choose another backend; nothing here reads a
    tensor's values. ``device_type`` and ``capability`` describe the device (by default the inputs' own; the
    dispatcher passes what it read once, outside torch.compile's trace).
    """
    key = query if key is None else key
    value = key if value is None else value
    device_type = query.device.type if device_type is None else device_type
    if triton is None:
        return "triton is not installed (pip install triton)"
    if TRITON_VERSION < MIN_TRITON_VERSION:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON_VERSION))}"
    if formulation not in FORMULATIONS:
        return f"formulation {formulation!r} is not one of {FORMULATIONS}"
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability(query.device) if capability is None else capability
        reason = capability_reason(capability, query.dtype, query.shape[-1], value.shape[-1])
    elif device_type == "cpu" and INTERPRETED:
        reason = None  # the interpreter has no architecture limits
    else:
        reason = (
            f"the kernels need CUDA tensors, got {device_type} (CPU tensors run only under the Triton "
            "interpreter, TRITON_INTERPRET=1 set before import)"
        )
    return reason or _input_reason(query, key, value, attn_mask, document_ids, max(p, default=None))


def capability_reason(capability, dtype, head_dim, value_dim):
    """None when a GPU of this compute capability has a checked configuration for these sizes, else why not."""
    if capability not in SHARED_MEMORY_LIMIT:
        known = ", ".join(f"{major}.{minor}" for major, minor in SHARED_MEMORY_LIMIT)
        return f"compute capability {capability[0]}.{capability[1]} is not one the kernels are checked for ({known})"
    if dtype in SUPPORTED_DTYPES and launch_config(dtype, head_dim, value_dim, capability) is None:
        largest = max(_configs(dtype, capability))
        return f"head sizes {head_dim} and {value_dim} in {dtype}: the kernels' tiles fit {largest} at most"
    return None


def _input_reason(query, key, value, attn_mask, document_ids, max_p):
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
    if document_ids is not None and document_ids.device != query.device:
        return f"document_ids are on {document_ids.device}, the inputs on {query.device}"
    # The kernels take contiguous tensors: rows * d offsets inside one (batch, head) slab are int32.
    extent = max(query.shape[2], key.shape[2]) * max(query.shape[-1], value.shape[-1])
    if extent > MAX_OFFSET:
        return "one (batch, head) of the inputs spans more than 2^31 elements: int32 offsets would overflow"
    programs = query.shape[0] * query.shape[1] * key.shape[2]  # above the programs of any grid (tiles of 16+)
    if programs > MAX_OFFSET:
        return f"B * H * Nk = {programs} is above 2^31: the grid would overflow"
    return None


def _key_padding_shape(attn_mask):
    """(B or 1, Nk or 1) when attn_mask is a key-padding mask, else None."""
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)  # (B|1, H|1, Nq|1, Nk|1)
    return (shape[0], shape[3]) if shape[1] == 1 and shape[2] == 1 else None


@jit
def _probe():
    pass


# Under the interpreter triton.jit returns interpreted functions instead of JITFunctions.
INTERPRETED = triton is not None and not isinstance(_probe, triton.runtime.JITFunction)
# The interpreter cannot run inline PTX: it takes numpy's logarithm instead of the MUFU one.
HARDWARE_LOG2 = constexpr(not INTERPRETED)
# Exponent classes of (D2 + eps) ** ((p - 2) / 2), one per p of a launch: any p through log2 and exp2, or
# p = 1.5 and 2.5 (the paper's) as square-root chains, two special-function operations instead of three.
POWER_ANY, POWER_MINUS_QUARTER, POWER_QUARTER = constexpr(0), constexpr(1), constexpr(2)
POWER_CLASSES = {1.5: 1, 2.5: 2}  # p -> POWER; any other p: POWER_ANY


@jit
def _program_ids(num_rows, head_start, run_heads, num_heads, BLOCK: constexpr, HEAVY_LAST: constexpr):
    """(row block, batch * H + head, head - head_start) of this program, for a run of heads head_start ... +
    run_heads. The grid is 1-D (CUDA caps axes 1 and 2 at 65535) and starts the longest loops first: a GPU starts
    programs in grid order, so that the short ones fill the last wave. The slabs (batch, head) vary fastest, and the row
    blocks go from the heaviest to the lightest: the last first where the loops grow with the block (HEAVY_LAST: query
    blocks under causal masking), else the first. The slab index is int64, as B * H * N * d may pass 2^31."""
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(num_rows, BLOCK)
    slabs = tl.num_programs(0) // num_blocks
    block = pid // slabs
    if HEAVY_LAST:
        block = num_blocks - 1 - block
    slab = pid % slabs
    run_head = slab % run_heads
    return block, (slab // run_heads).to(tl.int64) * num_heads + head_start + run_head, run_head


@jit
def _head_exponent(run_head, high_heads, exponent_low, exponent_high):
    """(whether this program's head takes the launch's second p, its exponent (p - 2) / 2): bit ``run_head`` of
    ``high_heads`` is set for the heads of the second p."""
    use_high = ((high_heads >> run_head) & 1) != 0
    return use_high, tl.where(use_high, exponent_high, exponent_low)


@jit
def _row_ptrs(ptr, rows, COLS: constexpr, BLOCK_COLS: constexpr):
    """Pointers and mask of rows of a contiguous (rows, COLS) matrix, padded to BLOCK_COLS columns."""
    cols = tl.arange(0, BLOCK_COLS)
    return ptr + rows[:, None] * COLS + cols[None, :], cols[None, :] < COLS


@jit
def _load_rows(ptr, rows, num_rows, COLS: constexpr, BLOCK_COLS: constexpr, CHECK_ROWS: constexpr = True):
    """(len(rows), BLOCK_COLS) tile of a contiguous (num_rows, COLS) matrix; zeros outside it. A plain tile's rows are
    all inside (CHECK_ROWS false): its loads skip the per-row predicates, which cost a loop iteration instructions."""
    ptrs, col_in = _row_ptrs(ptr, rows, COLS, BLOCK_COLS)
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < num_rows) & col_in, other=0.0)
    elif COLS == BLOCK_COLS:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=col_in, other=0.0)
    return tile


@jit
def _load_vector(ptr, index, size, other, CHECK: constexpr = True):
    """ptr[index], ``other`` where index >= size (CHECK false: every index is inside)."""
    if CHECK:
        vector = tl.load(ptr + index, mask=index < size, other=other)
    else:
        vector = tl.load(ptr + index)
    return vector


@jit
def _store_rows(ptr, rows, num_rows, tile, COLS: constexpr, BLOCK_COLS: constexpr):
    ptrs, col_in = _row_ptrs(ptr, rows, COLS, BLOCK_COLS)
    tl.store(ptrs, tile.to(ptr.dtype.element_ty), mask=(rows[:, None] < num_rows) & col_in)


@jit
def _log2(x):
    if HARDWARE_LOG2:  # MUFU.LG2; tl.log2 is libdevice's software logarithm, ~30 instructions
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return tl.log2(x)


@jit
def _reciprocal(x):
    if HARDWARE_LOG2:  # MUFU.RCP; 1 / x is a correctly rounded division, about 8 instructions
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return 1.0 / x


@jit
def _power(dist_eps, exponent, POWER: constexpr):
    """P = dist_eps ** exponent and 1 / dist_eps, with approximate special functions (relative error ~2^-22). The
    paper's classes take square roots: rsqrt then sqrt for -1/4 (1 / dist_eps its square), two sqrt for 1/4 and a
    reciprocal (the forward, which needs no 1 / dist_eps, drops it unused)."""
    if POWER == POWER_ANY:
        log = _log2(dist_eps)
        return tl.exp2(exponent * log), tl.exp2(-log)
    elif POWER == POWER_MINUS_QUARTER:
        rsqrt = tl.rsqrt(dist_eps)
        return tl.sqrt(rsqrt), rsqrt * rsqrt
    else:
        return tl.sqrt(tl.sqrt(dist_eps)), _reciprocal(dist_eps)


@jit
def _exponent(exponent, POWER: constexpr):
    """The exponent as a compile-time constant where its class fixes it."""
    if POWER == POWER_MINUS_QUARTER:
        exponent = -0.25
    elif POWER == POWER_QUARTER:
        exponent = 0.25
    return exponent


@jit
def _head_power(dist_eps, exponent, use_high, POWER_LOW: constexpr, POWER_HIGH: constexpr):
    """``_power`` in this program's head's class: a launch whose two p have two classes compiles both, and each
    program takes one branch per tile (the same in all its threads)."""
    if POWER_LOW == POWER_HIGH:
        power, inv_dist = _power(dist_eps, _exponent(exponent, POWER_LOW), POWER_LOW)
    elif use_high:
        power, inv_dist = _power(dist_eps, _exponent(exponent, POWER_HIGH), POWER_HIGH)
    else:
        power, inv_dist = _power(dist_eps, _exponent(exponent, POWER_LOW), POWER_LOW)
    return power, inv_dist


@jit
def _split_high(x, MASK: constexpr):
    """x with the low mantissa bits that MASK clears set to zero (exact in the narrower type that keeps the rest)."""
    return (x.to(tl.uint32, bitcast=True) & MASK).to(tl.float32, bitcast=True)


@jit
def _row_sums_init(rows: constexpr, values_dtype: constexpr, BY_MATMUL: constexpr):
    """The zero accumulator of ``_exact_dot``'s row sums: (rows, SUM_COLUMNS) where a matmul forms them, (rows,)
    otherwise."""
    if BY_MATMUL and values_dtype == tl.bfloat16:
        sums = tl.zeros([rows, SUM_COLUMNS], tl.float32)
    else:
        sums = tl.zeros([rows], tl.float32)
    return sums


@jit
def _row_sums(sums):
    """Each row's sum from ``_exact_dot``'s accumulator (its columns are equal where it has several)."""
    if len(sums.shape) == 2:
        sums = tl.max(sums, 1)
    return sums


@jit
def _part_dot(part, b, acc, sums, BY_MATMUL: constexpr):
    """``_exact_dot``'s matmul and row sums of one bfloat16 part."""
    part = part.to(tl.bfloat16)
    if BY_MATMUL:
        sums = tl.dot(part, tl.full([part.shape[1], SUM_COLUMNS], 1.0, tl.bfloat16), sums)
    else:
        sums += tl.sum(part.to(tl.float32), 1)
    return tl.dot(part, b, acc), sums


@jit
def _exact_dot(a, b, acc, sums, EXACT: constexpr, SUMS_BY_MATMUL: constexpr):
    """(acc + a @ b, sums + rowsum(a)) for a float32 ``a`` (a distance gradient) and half-precision ``b``, whose
    products are exact: ``a`` alone is rounded or split. The caller forms rowsum(a) v_x - a V, whose terms cancel
    where values are near: against bfloat16 the row sums come from the very parts the matmul takes (a matmul against
    a tile of ones, ``_row_sums_init``, or their float32 sums), so that the cancellation is exact and each term keeps
    its parts' rounding. The first pass takes ``a`` rounded to bfloat16 (2^-9 of each term, as W^T dU has of W's
    rounding): its blocks have no close pair. The exact pass splits it into three bfloat16 parts (24 bits, float32's) for the close pairs'
    terms, which dominate dV where values nearly coincide. 16-bit operands keep the accumulator's register layout,
    so that no part is shuffled to another. Against float16, whose range cannot hold ``a``, two TF32 parts (not
    tf32x3's three) against float32 row sums."""
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
def _pair_dot(query_side, key_side, QUERY_AXIS: constexpr, acc=None):
    """The tile of dot products of query-side rows (M, d) with key-side rows (N, d), added to ``acc`` if given."""
    if QUERY_AXIS == 0:
        tile = tl.dot(query_side, tl.trans(key_side), acc, input_precision=FLOAT32_DOT)
    else:
        tile = tl.dot(key_side, tl.trans(query_side), acc, input_precision=FLOAT32_DOT)
    return tile


@jit
def _fixed_documents(Documents, slab, num_heads, positions, num_keys, HAS_DOCUMENTS: constexpr):
    """What the tiles of a kernel's fixed block need of packed documents: (the row of the document table,
    the block's document ids, their smallest and largest id), and the span (first, end) of positions that
    its tokens may pair with. Without documents, the span of the whole row."""
    if HAS_DOCUMENTS:
        row = Documents + (slab // num_heads) * num_keys * 3
        inside = positions < num_keys
        ids = tl.load(row + positions * 3, mask=inside, other=-1)
        docs = (row, ids, tl.min(tl.where(inside, ids, num_keys)), tl.max(ids))
        first = tl.min(tl.load(row + positions * 3 + 1, mask=inside, other=num_keys))
        span = (first, tl.max(tl.load(row + positions * 3 + 2, mask=inside, other=0)))
    else:
        docs = (Documents, 0, 0, 0)
        span = (0, num_keys)
    return docs, span


@jit
def _masked_scores(scores, rows, cols, num_queries, num_keys, key_keep_row, docs, MASKED: constexpr,
                   IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr, HAS_DOCUMENTS: constexpr,
                   QUERY_AXIS: constexpr):  # fmt: skip
    """-inf where query rows may not attend to key cols (out of range, causal, padding, another document);
    tiles that the loop split proves whole and allowed (MASKED false) skip the test, and with documents they
    compare ids only where the tile's tokens are not all of the fixed block's one document."""
    if HAS_DOCUMENTS:  # tiles are (fixed block, loop block); Nq == Nk
        row, fixed_ids, fixed_low, fixed_high = docs
        loop_positions = cols if QUERY_AXIS == 0 else rows
        loop_ids = tl.load(row + loop_positions * 3, mask=loop_positions < num_keys, other=-1)
        same_document = fixed_ids[:, None] == loop_ids[None, :]
    if MASKED:
        query_pos = _per_query(rows, QUERY_AXIS)
        key_pos = _per_key(cols, QUERY_AXIS)
        allowed = (query_pos < num_queries) & (key_pos < num_keys)
        if IS_CAUSAL:
            allowed = allowed & (key_pos <= query_pos + (num_keys - num_queries))
        if HAS_KEY_MASK:
            keep = tl.load(key_keep_row + cols, mask=cols < num_keys, other=0)
            allowed = allowed & (_per_key(keep, QUERY_AXIS) != 0)
        if HAS_DOCUMENTS:
            allowed = allowed & same_document
        scores = tl.where(allowed, scores, float("-inf"))
    elif HAS_DOCUMENTS:
        # Every id equal: min(loop) = max(fixed) >= min(fixed) = max(loop) >= min(loop).
        if (tl.min(loop_ids) != fixed_high) | (tl.max(loop_ids) != fixed_low):
            scores = tl.where(same_document, scores, float("-inf"))
    return scores


@jit
def _close_bounds(sq_fixed_eps, eps, QUERY_AXIS: constexpr):
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
def _distances(v_query, sq_query, close_bounds, values, sq_keys, V, rows, cols, num_keys, offset, eps,
               VALUE_DIM: constexpr, MASKED: constexpr, QUERY_AXIS: constexpr, EXACT: constexpr):  # fmt: skip
    """D2 + eps from the squared norms (eps in the fixed block's, added once per program, not in the loop's) and the
    values, the self-pair tile (None-free: all false where the loop split excludes self pairs, MASKED false), and
    which rows of the tile (the fixed block's) have close pairs (int32 per row: a loop accumulates them without
    reducing across warps in every tile). Where queries are the fixed block (forward, dq) their values come as -2 v_x
    (``_times_minus_two``), so that the matmul accumulates -2 v_x.v_y onto the norms; dk/dv's fixed values also form
    G = dU V^T, so that it scales the products instead (docs/performance.md).

    The expansion's rounding, a few u (|v_x|^2 + |v_y|^2), would decide P where values nearly coincide: a tile with
    close pairs (CLOSE_PAIR) recomputes all its pairs by direct differences, one value coordinate at a time from
    memory (no second tile and no mask stay live across that loop), and sets its coinciding pairs (COINCIDING) to
    exactly eps. Self pairs are exactly eps without it, and pairs outside the inputs are masked: in the masked tiles
    (the diagonal band, the partial ones) neither makes the tile recompute. Elsewhere the expansion is positive.
    Without EXACT the tile keeps the expansion and only reports its close pairs (the forward's first pass reads them,
    the backward's, whose blocks the forward has cleared, leave them unused)."""
    sq_sums = _per_query(sq_query, QUERY_AXIS) + _per_key(sq_keys, QUERY_AXIS)
    if QUERY_AXIS == 0:
        dist_eps = _pair_dot(v_query, values, QUERY_AXIS, sq_sums)
    else:
        dist_eps = sq_sums - 2 * _pair_dot(v_query, values, QUERY_AXIS)
    sq_query_eps = sq_query
    if QUERY_AXIS == 1:
        sq_query_eps += eps
    is_self = _per_key(cols, QUERY_AXIS) == _per_query(rows, QUERY_AXIS) + offset
    if MASKED:
        inside = (_per_query(rows, QUERY_AXIS) < num_keys - offset) & (_per_key(cols, QUERY_AXIS) < num_keys)
        close = dist_eps <= _per_query(sq_query_eps * CLOSE_PAIR + eps, QUERY_AXIS)
        close_rows = tl.max((close & inside & ~is_self).to(tl.int32), 1)
    else:
        # One comparison per row, not per pair: the row's nearest pair against the row's bound.
        close_rows = (tl.min(dist_eps, 1) <= close_bounds).to(tl.int32)
    if EXACT and _any(close_rows):
        query_in, key_in = rows < num_keys - offset, cols < num_keys
        dist_eps = tl.zeros_like(dist_eps)
        for dim in range(VALUE_DIM):
            query_side = tl.load(V + (rows + offset) * VALUE_DIM + dim, mask=query_in, other=0.0).to(tl.float32)
            key_side = tl.load(V + cols * VALUE_DIM + dim, mask=key_in, other=0.0).to(tl.float32)
            diff = _per_query(query_side, QUERY_AXIS) - _per_key(key_side, QUERY_AXIS)
            dist_eps += diff * diff
        bound = COINCIDING * (sq_sums - eps)
        dist_eps = tl.where(dist_eps <= bound, 0.0, dist_eps) + eps
    if MASKED:
        dist_eps = tl.where(is_self, eps, dist_eps)
    return dist_eps, is_self & MASKED, close_rows


@jit
def _times_minus_two(values):
    """-2 values, exact in any float type: the query values that ``_distances`` takes where queries are the fixed
    block."""
    return (values.to(tl.float32) * -2.0).to(values.dtype)


@jit
def _any(close_rows):
    return tl.max(close_rows) != 0


@jit
def _loop_split(begin, a, b, c, end, span, BLOCK: constexpr):
    """The tiles of a loop over [begin, end) as two lists: plain tiles [begin, a) and [b, c), whose pairs are
    all allowed (but for packed documents), in range and off the diagonal, and masked tiles [a, b) and
    [max(b, c), end); tiles outside the span (first, end) of positions that the fixed block pairs with are
    skipped. Each list is (count, count of its first range, first start, second start), read by
    ``_tile_start``; a, b and c are multiples of BLOCK from begin wherever a range follows them."""
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
def _tile_start(index, tiles, BLOCK: constexpr):
    first_count, first_start, second_start = tiles[1], tiles[2], tiles[3]
    return tl.where(index < first_count, first_start + index * BLOCK, second_start + (index - first_count) * BLOCK)


@jit
def _key_loop_bounds(pid_m, num_queries, num_keys, span, BLOCK_M: constexpr, BLOCK_N: constexpr,
                     IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr):  # fmt: skip
    """The ``_loop_split`` of a query block's loop over key blocks (forward and dq)."""
    offset = num_keys - num_queries
    first_key = offset + pid_m * BLOCK_M  # the key position of the block's first query
    full_end = num_keys // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        end = tl.minimum(num_keys, first_key + BLOCK_M)
        a = tl.minimum(full_end, first_key // BLOCK_N * BLOCK_N)  # below the diagonal: no self pair either
        b = end
        c = end
    else:
        end = num_keys
        a = tl.minimum(full_end, first_key // BLOCK_N * BLOCK_N)
        b = tl.maximum(a, tl.minimum(end, tl.cdiv(tl.minimum(first_key + BLOCK_M, num_keys), BLOCK_N) * BLOCK_N))
        c = full_end
    if HAS_KEY_MASK:
        a = 0
        b = end
        c = end
    return _loop_split(0, a, b, c, end, span, BLOCK_N)


@jit
def _query_loop_bounds(pid_n, num_queries, num_keys, span, BLOCK_M: constexpr, BLOCK_N: constexpr,
                       IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr):  # fmt: skip
    """The ``_loop_split`` of a key block's loop over query blocks (dkdv)."""
    offset = num_keys - num_queries
    first_query = pid_n * BLOCK_N - offset  # the query at the block's first key position (may be < 0)
    full_end = num_queries // BLOCK_M * BLOCK_M
    begin = 0
    if IS_CAUSAL:  # queries before the block's first key never see it
        begin = tl.maximum(first_query, 0) // BLOCK_M * BLOCK_M
        a = begin
        b = tl.minimum(full_end, tl.cdiv(tl.maximum(first_query + BLOCK_N, 0), BLOCK_M) * BLOCK_M)
        b = tl.maximum(b, begin)
        c = full_end
    else:
        a = tl.minimum(full_end, tl.maximum(first_query, 0) // BLOCK_M * BLOCK_M)
        band_end = tl.cdiv(tl.minimum(tl.maximum(first_query + BLOCK_N, 0), num_queries), BLOCK_M) * BLOCK_M
        b = tl.maximum(a, tl.minimum(num_queries, band_end))
        c = full_end
    if HAS_KEY_MASK:
        a = begin
        b = num_queries
        c = num_queries
    return _loop_split(begin, a, b, c, num_queries, span, BLOCK_M)


@jit
def _forward_flagged(Flags, first, size, SPAN: constexpr, FLAG_BLOCK: constexpr):
    """Whether the forward flagged a block of FLAG_BLOCK positions that holds any of [first, first + SPAN) (below
    ``size``): a backward program's own flag, its block's queries (dq) or keys (dk/dv) against the forward's query
    blocks or key tiles."""
    positions = first + tl.arange(0, SPAN)
    return tl.max(tl.load(Flags + positions // FLAG_BLOCK, mask=positions < size, other=0)) != 0


@jit
def _pass_rows(exact_block, has_close, num_rows, EXACT: constexpr):
    """How many rows of its block a forward program stores in this pass, all or none; the first pass records its flag
    (1 where a tile had close pairs, whose distances it left expanded). The exact pass runs flagged blocks only."""
    if EXACT:
        stored = num_rows
    else:
        tl.store(exact_block, has_close)
        stored = tl.where(has_close != 0, 0, num_rows)
    return stored


@jit
def _fwd_tile(q, v_query_m2, sq_query_eps, close_bounds, row_max, row_sum, off_sum, acc, K, V, SqNorms, KeyTiles,
              key_keep_row, docs, rows, start, num_queries, num_keys, scale_log2, exponent, use_high, eps,
              HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr, BLOCK_N: constexpr,
              POWER_LOW: constexpr, POWER_HIGH: constexpr, MASKED: constexpr, IS_CAUSAL: constexpr,
              HAS_KEY_MASK: constexpr, HAS_DOCUMENTS: constexpr, EULER: constexpr, EXACT: constexpr):  # fmt: skip
    """One key block of the online softmax, and whether it has close pairs (the exact pass flags its key tile for the
    backward); scores in log2 units (log2(e) folded into the scale)."""
    cols = start + tl.arange(0, BLOCK_N)
    k = _load_rows(K, cols, num_keys, HEAD_DIM, BLOCK_D, MASKED)
    values = _load_rows(V, cols, num_keys, VALUE_DIM, BLOCK_DV, MASKED)
    sq_keys = _load_vector(SqNorms, cols, num_keys, 0.0, MASKED)
    # q.k unscaled: the scale (> 0) multiplies the row maxima, and joins each score's exp2 argument as one FMA.
    scores = _masked_scores(_pair_dot(q, k, 0), rows, cols, num_queries, num_keys, key_keep_row, docs, MASKED,
                            IS_CAUSAL, HAS_KEY_MASK, HAS_DOCUMENTS, 0)  # fmt: skip
    new_max = tl.maximum(row_max, tl.max(scores, 1) * scale_log2)
    rescale = tl.exp2(row_max - new_max)
    expo = tl.exp2(scores * scale_log2 - new_max[:, None])
    row_sum = row_sum * rescale + tl.sum(expo, 1)
    dist_eps, is_self, has_close = _distances(v_query_m2, sq_query_eps, close_bounds, values, sq_keys, V, rows, cols,
                                              num_keys, num_keys - num_queries, eps, VALUE_DIM, MASKED, 0,
                                              EXACT)  # fmt: skip
    if EXACT:
        if _any(has_close):
            tl.store(KeyTiles + start // BLOCK_N, 1)
    weights = expo * _head_power(dist_eps, exponent, use_high, POWER_LOW, POWER_HIGH)[0]
    if EULER:
        if MASKED:
            weights = tl.where(is_self, 0.0, weights)
        off_sum = off_sum * rescale + tl.sum(weights, 1)
    acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=FLOAT32_DOT)
    return new_max, row_sum, off_sum, acc, has_close


@jit(do_not_specialize=["high_heads"])  # a bit mask, not a size: one compilation serves every layout of p
def _plap_fwd_kernel(
    Q, K, V, SqNorms, KeyKeep, Documents, Out, Lse, OwnWeight, ExactBlocks, KeyTiles,
    head_start, run_heads, num_heads, num_queries, num_keys, scale_log2, exponent_low, exponent_high,
    high_heads, eps,
    HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr, BLOCK_M: constexpr,
    BLOCK_N: constexpr, POWER_LOW: constexpr, POWER_HIGH: constexpr, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr,
    HAS_DOCUMENTS: constexpr, EULER: constexpr, EXACT: constexpr,
):  # fmt: skip
    """Two passes over the same grid, as each kernel here runs. The first (EXACT false) computes D2 + eps by the
    expansion alone; a block with a close pair in any tile stores nothing but its flag in ExactBlocks (int32 per
    block, written by every program). The second (EXACT) redoes the flagged blocks with the close pairs' direct
    differences, and sets KeyTiles (int32 per key tile of BLOCK_N, zero before) where a tile had some; the others
    leave at once. The backward's passes follow both flags. The exact path's code and registers stay out of the first
    pass, which fits more blocks per SM. (A flagged block's first-pass values may be inf or NaN where the expansion
    went to zero or below: never stored.)"""
    pid_m, slab, run_head = _program_ids(num_queries, head_start, run_heads, num_heads, BLOCK_M, IS_CAUSAL)
    exact_block = ExactBlocks + slab * tl.cdiv(num_queries, BLOCK_M) + pid_m
    if EXACT:
        if tl.load(exact_block) == 0:  # not flagged: leave before loading anything (the pass's grid is the first's)
            return
    use_high, exponent = _head_exponent(run_head, high_heads, exponent_low, exponent_high)
    offset = num_keys - num_queries  # query i is the token at key position offset + i
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    K += slab * num_keys * HEAD_DIM
    V += slab * num_keys * VALUE_DIM
    SqNorms += slab * num_keys
    KeyTiles += slab * tl.cdiv(num_keys, BLOCK_N)
    stats = slab * num_queries  # Lse and OwnWeight are (B, H, Nq)
    key_keep_row = KeyKeep + (slab // num_heads) * num_keys
    q = _load_rows(Q + slab * num_queries * HEAD_DIM, rows, num_queries, HEAD_DIM, BLOCK_D)
    v_query = _load_rows(V, rows + offset, num_keys, VALUE_DIM, BLOCK_DV)
    v_query_m2 = _times_minus_two(v_query)
    sq_query_eps = _load_vector(SqNorms + offset, rows, num_queries, 0.0) + eps
    close_bounds = _close_bounds(sq_query_eps, eps, 0)
    docs, span = _fixed_documents(Documents, slab, num_heads, rows, num_keys, HAS_DOCUMENTS)

    row_max = tl.full([BLOCK_M], MIN_SCORE, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    off_sum = tl.zeros([BLOCK_M], tl.float32)  # rowsum(W_off) * running normaliser, euler only
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    plain, masked = _key_loop_bounds(pid_m, num_queries, num_keys, span, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                     HAS_KEY_MASK)  # fmt: skip
    num_plain, num_masked = plain[0], masked[0]
    has_close = tl.zeros([BLOCK_M], tl.int32)  # per query: whether its tiles had close pairs
    for index in range(0, num_plain):
        row_max, row_sum, off_sum, acc, close = _fwd_tile(
            q, v_query_m2, sq_query_eps, close_bounds, row_max, row_sum, off_sum, acc, K, V, SqNorms, KeyTiles,
            key_keep_row, docs, rows,
            _tile_start(index, plain, BLOCK_N), num_queries, num_keys, scale_log2, exponent, use_high, eps,
            HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_N, POWER_LOW, POWER_HIGH, False, IS_CAUSAL, HAS_KEY_MASK,
            HAS_DOCUMENTS, EULER, EXACT,
        )  # fmt: skip
        has_close |= close
    for index in range(0, num_masked):
        row_max, row_sum, off_sum, acc, close = _fwd_tile(
            q, v_query_m2, sq_query_eps, close_bounds, row_max, row_sum, off_sum, acc, K, V, SqNorms, KeyTiles,
            key_keep_row, docs, rows,
            _tile_start(index, masked, BLOCK_N), num_queries, num_keys, scale_log2, exponent, use_high, eps,
            HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_N, POWER_LOW, POWER_HIGH, True, IS_CAUSAL, HAS_KEY_MASK,
            HAS_DOCUMENTS, EULER, EXACT,
        )  # fmt: skip
        has_close |= close

    stored_rows = _pass_rows(exact_block, tl.max(has_close), num_queries, EXACT)
    row_in = rows < stored_rows
    valid = row_sum > 0  # at least one allowed key; fully masked rows output zeros
    inv_sum = 1.0 / tl.where(valid, row_sum, 1.0)
    out = acc * inv_sum[:, None]
    if EULER:
        own_weight = tl.where(valid, 1.0 - off_sum * inv_sum, 0.0)  # u_x = v_x (1 - rowsum W_off) + W_off V
        out += own_weight[:, None] * v_query.to(tl.float32)
        tl.store(OwnWeight + stats + rows, own_weight, mask=row_in)
    _store_rows(Out + slab * num_queries * VALUE_DIM, rows, stored_rows, out, VALUE_DIM, BLOCK_DV)
    # In log2 units; +inf on fully masked rows makes the backward's exp2(s - lse) exactly 0 there.
    lse = row_max + tl.log2(tl.where(valid, row_sum, 1.0))
    tl.store(Lse + stats + rows, tl.where(valid, lse, float("inf")), mask=row_in)


@jit
def _tile_grads(
    q, k, v_query, values, sq_query, close_bounds, sq_keys, grad_out, lse, delta, own_dot, V, rows, cols,
    key_keep_row, docs, num_queries, num_keys, scale_log2, exponent, use_high, eps, VALUE_DIM: constexpr,
    POWER_LOW: constexpr, POWER_HIGH: constexpr, MASKED: constexpr, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr,
    HAS_DOCUMENTS: constexpr, EULER: constexpr, QUERY_AXIS: constexpr, EXACT: constexpr,
):  # fmt: skip
    """Recompute one tile (``v_query`` as ``_distances`` takes it): W (W_off for euler), dS and -2 dL/dD2 (0 where
    D2 + eps is eps: self and coinciding pairs, whose exact gradient through D2 is 0 and whose computed one would be
    rounding), and whether it has close pairs (without EXACT their distances stay expanded: the caller discards such
    tiles). The sign joins the constant 2 (p - 2) / 2, so that the distance matmuls take it without a negation per
    score."""
    scores = _masked_scores(_pair_dot(q, k, QUERY_AXIS) * scale_log2, rows, cols, num_queries, num_keys,
                            key_keep_row, docs, MASKED, IS_CAUSAL, HAS_KEY_MASK, HAS_DOCUMENTS,
                            QUERY_AXIS)  # fmt: skip
    attn = tl.exp2(scores - _per_query(lse, QUERY_AXIS))
    dist_eps, is_self, has_close = _distances(v_query, sq_query, close_bounds, values, sq_keys, V, rows, cols,
                                              num_keys, num_keys - num_queries, eps, VALUE_DIM, MASKED, QUERY_AXIS,
                                              EXACT)  # fmt: skip
    power, inv_dist = _head_power(dist_eps, exponent, use_high, POWER_LOW, POWER_HIGH)
    weights = attn * power
    grad_w = _pair_dot(grad_out, values, QUERY_AXIS)  # G = dU V^T
    if EULER:
        if MASKED:
            weights = tl.where(is_self, 0.0, weights)
        grad_w -= _per_query(own_dot, QUERY_AXIS)  # dW = G - dU.v_x
    weighted = weights * grad_w
    grad_scores = weighted - attn * _per_query(delta, QUERY_AXIS)
    grad_dist = (-2 * exponent) * weighted * inv_dist
    if MASKED:  # self pairs
        grad_dist = tl.where(dist_eps == eps, 0.0, grad_dist)
    elif EXACT:
        if _any(has_close):
            grad_dist = tl.where(dist_eps == eps, 0.0, grad_dist)
    return weights, grad_scores, grad_dist, has_close


@jit
def _query_side(slab, rows, V, SqNorms, GradOut, Lse, Delta, OwnDot, num_queries, num_keys, eps,
                VALUE_DIM: constexpr, BLOCK_DV: constexpr, LOAD_STATS: constexpr, CHECK_ROWS: constexpr):  # fmt: skip
    """What a backward tile needs of a block of queries besides q: own values, their squared norms (without eps: the
    fixed block's carry it), dU, the logsumexp, and (``LOAD_STATS``) the row statistics."""
    offset = num_keys - num_queries
    stats = slab * num_queries
    v_query = _load_rows(V + offset * VALUE_DIM, rows, num_queries, VALUE_DIM, BLOCK_DV, CHECK_ROWS)
    sq_query = _load_vector(SqNorms + offset, rows, num_queries, 0.0, CHECK_ROWS)
    grad_out = _load_rows(GradOut + stats * VALUE_DIM, rows, num_queries, VALUE_DIM, BLOCK_DV, CHECK_ROWS)
    lse = _load_vector(Lse + stats, rows, num_queries, float("inf"), CHECK_ROWS)
    delta = lse  # not read: the dq kernel computes its own (``_row_stats``)
    own_dot = lse
    if LOAD_STATS:
        delta = _load_vector(Delta + stats, rows, num_queries, 0.0, CHECK_ROWS)
        own_dot = _load_vector(OwnDot + stats, rows, num_queries, 0.0, CHECK_ROWS)
    return v_query, sq_query, grad_out, lse, delta, own_dot


@jit
def _row_stats(Out, Delta, OwnDot, slab, rows, grad_out, v_query, num_queries, VALUE_DIM: constexpr,
               BLOCK_DV: constexpr, EULER: constexpr):  # fmt: skip
    """FlashAttention's D = rowsum(dU * U) of the dq kernel's own queries, in float32 from the stored operands;
    euler subtracts the own-value part dU . v_x (its ``own_dot``), which the paper formulation never reads. Stored
    for the dkdv kernel, launched after, whose loops read every query's: by the pass that runs the block."""
    grad_out = grad_out.to(tl.float32)
    out = _load_rows(Out + slab * num_queries * VALUE_DIM, rows, num_queries, VALUE_DIM, BLOCK_DV)
    delta = tl.sum(grad_out * out.to(tl.float32), 1)
    own_dot = delta
    if EULER:
        own_dot = tl.sum(grad_out * v_query.to(tl.float32), 1)
        delta -= own_dot
    row_in = rows < num_queries
    tl.store(Delta + slab * num_queries + rows, delta, mask=row_in)
    if EULER:
        tl.store(OwnDot + slab * num_queries + rows, own_dot, mask=row_in)
    return delta, own_dot


@jit
def _dkdv_tile(grad_k, grad_v, grad_dist_sum, k, values, sq_keys_eps, close_bounds, cols, start, slab, Q, V, SqNorms,
               GradOut, Lse, Delta, OwnDot, key_keep_row, docs, num_queries, num_keys, scale_log2, exponent, use_high,
               eps, HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
               BLOCK_M: constexpr, POWER_LOW: constexpr, POWER_HIGH: constexpr, MASKED: constexpr, IS_CAUSAL: constexpr,
               HAS_KEY_MASK: constexpr, HAS_DOCUMENTS: constexpr, EULER: constexpr, EXACT: constexpr,
               SUMS_BY_MATMUL: constexpr):  # fmt: skip
    rows = start + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + slab * num_queries * HEAD_DIM, rows, num_queries, HEAD_DIM, BLOCK_D, MASKED)
    v_query, sq_query, grad_out, lse, delta, own_dot = _query_side(
        slab, rows, V, SqNorms, GradOut, Lse, Delta, OwnDot, num_queries, num_keys, eps, VALUE_DIM, BLOCK_DV, True,
        MASKED,
    )  # fmt: skip
    # (keys, queries) tiles
    weights, grad_scores, grad_dist, _ = _tile_grads(
        q, k, v_query, values, sq_query, close_bounds, sq_keys_eps, grad_out, lse, delta, own_dot, V, rows, cols,
        key_keep_row, docs, num_queries, num_keys, scale_log2, exponent, use_high, eps, VALUE_DIM, POWER_LOW,
        POWER_HIGH, MASKED, IS_CAUSAL, HAS_KEY_MASK, HAS_DOCUMENTS, EULER, 1, EXACT,
    )  # fmt: skip
    grad_v += tl.dot(weights.to(grad_out.dtype), grad_out, input_precision=FLOAT32_DOT)
    grad_k += tl.dot(grad_scores.to(q.dtype), q, input_precision=FLOAT32_DOT)
    # Key side of the distances: dv_y += 2 sum_x dL/dD2 (v_y - v_x) (grad_dist is -2 dL/dD2); the v_y term after the
    # loop.
    grad_v, grad_dist_sum = _exact_dot(grad_dist, v_query, grad_v, grad_dist_sum, EXACT, SUMS_BY_MATMUL)
    return grad_k, grad_v, grad_dist_sum


@jit(do_not_specialize=["high_heads"])
def _plap_bwd_dkdv_kernel(
    Q, K, V, SqNorms, KeyKeep, Documents, GradOut, Lse, Delta, OwnDot, GradVOwn, GradK, GradV, KeyTiles,
    head_start, run_heads, num_heads, num_queries, num_keys, scale_log2, exponent_low, exponent_high,
    high_heads, eps,
    HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr, BLOCK_M: constexpr,
    BLOCK_N: constexpr, POWER_LOW: constexpr, POWER_HIGH: constexpr, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr,
    HAS_DOCUMENTS: constexpr, EULER: constexpr, EXACT: constexpr, FLAG_BLOCK: constexpr, SUMS_BY_MATMUL: constexpr,
):  # fmt: skip
    """A key block goes to the exact pass where the forward's exact pass flagged a key tile (FLAG_BLOCK keys) that
    holds any of its keys, and to the first pass otherwise; each pass leaves the other's blocks at once."""
    pid_n, slab, run_head = _program_ids(num_keys, head_start, run_heads, num_heads, BLOCK_N, False)
    KeyTiles += slab * tl.cdiv(num_keys, FLAG_BLOCK)
    if _forward_flagged(KeyTiles, pid_n * BLOCK_N, num_keys, BLOCK_N, FLAG_BLOCK) != EXACT:
        return
    use_high, exponent = _head_exponent(run_head, high_heads, exponent_low, exponent_high)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    V += slab * num_keys * VALUE_DIM
    SqNorms += slab * num_keys
    key_keep_row = KeyKeep + (slab // num_heads) * num_keys
    k = _load_rows(K + slab * num_keys * HEAD_DIM, cols, num_keys, HEAD_DIM, BLOCK_D)
    values = _load_rows(V, cols, num_keys, VALUE_DIM, BLOCK_DV)
    sq_keys_eps = _load_vector(SqNorms, cols, num_keys, 0.0) + eps
    close_bounds = _close_bounds(sq_keys_eps, eps, 1)
    docs, span = _fixed_documents(Documents, slab, num_heads, cols, num_keys, HAS_DOCUMENTS)

    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    grad_dist_sum = _row_sums_init(BLOCK_N, V.dtype.element_ty, SUMS_BY_MATMUL)
    plain, masked = _query_loop_bounds(pid_n, num_queries, num_keys, span, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                       HAS_KEY_MASK)  # fmt: skip
    num_plain, num_masked = plain[0], masked[0]
    for index in range(0, num_plain):
        grad_k, grad_v, grad_dist_sum = _dkdv_tile(
            grad_k, grad_v, grad_dist_sum, k, values, sq_keys_eps, close_bounds, cols,
            _tile_start(index, plain, BLOCK_M), slab, Q, V, SqNorms, GradOut, Lse, Delta, OwnDot, key_keep_row, docs,
            num_queries, num_keys, scale_log2, exponent, use_high, eps, HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV,
            BLOCK_M, POWER_LOW, POWER_HIGH, False, IS_CAUSAL, HAS_KEY_MASK, HAS_DOCUMENTS, EULER, EXACT, SUMS_BY_MATMUL,
        )  # fmt: skip
    for index in range(0, num_masked):
        grad_k, grad_v, grad_dist_sum = _dkdv_tile(
            grad_k, grad_v, grad_dist_sum, k, values, sq_keys_eps, close_bounds, cols,
            _tile_start(index, masked, BLOCK_M), slab, Q, V, SqNorms, GradOut, Lse, Delta, OwnDot, key_keep_row, docs,
            num_queries, num_keys, scale_log2, exponent, use_high, eps, HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV,
            BLOCK_M, POWER_LOW, POWER_HIGH, True, IS_CAUSAL, HAS_KEY_MASK, HAS_DOCUMENTS, EULER, EXACT, SUMS_BY_MATMUL,
        )  # fmt: skip

    grad_v -= _row_sums(grad_dist_sum)[:, None] * values.to(tl.float32)
    # The dq kernel, launched before, left each query's own-value part in float32 (the keys at or after the offset
    # are queries' values); dv is stored once, in the values' dtype.
    offset = num_keys - num_queries
    own_ptrs, col_in = _row_ptrs(GradVOwn + slab * num_queries * VALUE_DIM, cols - offset, VALUE_DIM, BLOCK_DV)
    grad_v += tl.load(own_ptrs, mask=((cols >= offset) & (cols < num_keys))[:, None] & col_in, other=0.0)
    _store_rows(GradK + slab * num_keys * HEAD_DIM, cols, num_keys, grad_k * (scale_log2 * LN_2), HEAD_DIM,
                BLOCK_D)  # fmt: skip
    _store_rows(GradV + slab * num_keys * VALUE_DIM, cols, num_keys, grad_v, VALUE_DIM, BLOCK_DV)


@jit
def _dq_tile(grad_q, grad_v_own, grad_dist_sum, q, v_query_m2, sq_query_eps, close_bounds, grad_out, lse, delta,
             own_dot, rows, start, K, V, SqNorms, key_keep_row, docs, num_queries, num_keys, scale_log2, exponent,
             use_high, eps, HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
             BLOCK_N: constexpr, POWER_LOW: constexpr, POWER_HIGH: constexpr, MASKED: constexpr, IS_CAUSAL: constexpr,
             HAS_KEY_MASK: constexpr, HAS_DOCUMENTS: constexpr, EULER: constexpr, EXACT: constexpr,
             SUMS_BY_MATMUL: constexpr):  # fmt: skip
    cols = start + tl.arange(0, BLOCK_N)
    k = _load_rows(K, cols, num_keys, HEAD_DIM, BLOCK_D, MASKED)
    values = _load_rows(V, cols, num_keys, VALUE_DIM, BLOCK_DV, MASKED)
    sq_keys = _load_vector(SqNorms, cols, num_keys, 0.0, MASKED)
    weights, grad_scores, grad_dist, _ = _tile_grads(
        q, k, v_query_m2, values, sq_query_eps, close_bounds, sq_keys, grad_out, lse, delta, own_dot, V, rows, cols,
        key_keep_row, docs, num_queries, num_keys, scale_log2, exponent, use_high, eps, VALUE_DIM, POWER_LOW,
        POWER_HIGH, MASKED, IS_CAUSAL, HAS_KEY_MASK, HAS_DOCUMENTS, EULER, 0, EXACT,
    )  # fmt: skip
    grad_q += tl.dot(grad_scores.to(k.dtype), k, input_precision=FLOAT32_DOT)
    grad_v_own, grad_dist_sum = _exact_dot(grad_dist, values, grad_v_own, grad_dist_sum, EXACT, SUMS_BY_MATMUL)
    return grad_q, grad_v_own, grad_dist_sum


@jit(do_not_specialize=["high_heads"])
def _plap_bwd_dq_kernel(
    Q, K, V, SqNorms, KeyKeep, Documents, GradOut, Lse, Delta, OwnDot, Out, OwnWeight, GradQ, GradVOwn, QueryBlocks,
    head_start, run_heads, num_heads, num_queries, num_keys, scale_log2, exponent_low, exponent_high,
    high_heads, eps,
    HEAD_DIM: constexpr, VALUE_DIM: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr, BLOCK_M: constexpr,
    BLOCK_N: constexpr, POWER_LOW: constexpr, POWER_HIGH: constexpr, IS_CAUSAL: constexpr, HAS_KEY_MASK: constexpr,
    HAS_DOCUMENTS: constexpr, EULER: constexpr, EXACT: constexpr, FLAG_BLOCK: constexpr, SUMS_BY_MATMUL: constexpr,
):  # fmt: skip
    """A query block goes to the exact pass where the forward flagged one of its query blocks (FLAG_BLOCK queries)
    that holds any of this block's queries, and to the first pass otherwise; each pass leaves the other's blocks at
    once."""
    pid_m, slab, run_head = _program_ids(num_queries, head_start, run_heads, num_heads, BLOCK_M, IS_CAUSAL)
    QueryBlocks += slab * tl.cdiv(num_queries, FLAG_BLOCK)
    if _forward_flagged(QueryBlocks, pid_m * BLOCK_M, num_queries, BLOCK_M, FLAG_BLOCK) != EXACT:
        return
    use_high, exponent = _head_exponent(run_head, high_heads, exponent_low, exponent_high)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    K += slab * num_keys * HEAD_DIM
    V += slab * num_keys * VALUE_DIM
    SqNorms += slab * num_keys
    key_keep_row = KeyKeep + (slab // num_heads) * num_keys
    q = _load_rows(Q + slab * num_queries * HEAD_DIM, rows, num_queries, HEAD_DIM, BLOCK_D)
    v_query, sq_query, grad_out, lse, _, _ = _query_side(
        slab, rows, V, SqNorms, GradOut, Lse, Delta, OwnDot, num_queries, num_keys, eps, VALUE_DIM, BLOCK_DV, False,
        True,
    )  # fmt: skip
    v_query_m2 = _times_minus_two(v_query)
    sq_query_eps = sq_query + eps
    close_bounds = _close_bounds(sq_query_eps, eps, 0)
    delta, own_dot = _row_stats(Out, Delta, OwnDot, slab, rows, grad_out, v_query, num_queries, VALUE_DIM, BLOCK_DV,
                                EULER)  # fmt: skip
    docs, span = _fixed_documents(Documents, slab, num_heads, rows, num_keys, HAS_DOCUMENTS)

    grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    grad_v_own = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # query side of the distances
    grad_dist_sum = _row_sums_init(BLOCK_M, V.dtype.element_ty, SUMS_BY_MATMUL)
    plain, masked = _key_loop_bounds(pid_m, num_queries, num_keys, span, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                     HAS_KEY_MASK)  # fmt: skip
    num_plain, num_masked = plain[0], masked[0]
    for index in range(0, num_plain):
        grad_q, grad_v_own, grad_dist_sum = _dq_tile(
            grad_q, grad_v_own, grad_dist_sum, q, v_query_m2, sq_query_eps, close_bounds, grad_out, lse, delta,
            own_dot,
            rows,
            _tile_start(index, plain, BLOCK_N), K, V, SqNorms, key_keep_row, docs, num_queries, num_keys, scale_log2,
            exponent, use_high, eps, HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_N, POWER_LOW, POWER_HIGH, False,
            IS_CAUSAL, HAS_KEY_MASK, HAS_DOCUMENTS, EULER, EXACT, SUMS_BY_MATMUL,
        )  # fmt: skip
    for index in range(0, num_masked):
        grad_q, grad_v_own, grad_dist_sum = _dq_tile(
            grad_q, grad_v_own, grad_dist_sum, q, v_query_m2, sq_query_eps, close_bounds, grad_out, lse, delta,
            own_dot,
            rows,
            _tile_start(index, masked, BLOCK_N), K, V, SqNorms, key_keep_row, docs, num_queries, num_keys, scale_log2,
            exponent, use_high, eps, HEAD_DIM, VALUE_DIM, BLOCK_D, BLOCK_DV, BLOCK_N, POWER_LOW, POWER_HIGH, True,
            IS_CAUSAL, HAS_KEY_MASK, HAS_DOCUMENTS, EULER, EXACT, SUMS_BY_MATMUL,
        )  # fmt: skip

    _store_rows(GradQ + slab * num_queries * HEAD_DIM, rows, num_queries, grad_q * (scale_log2 * LN_2), HEAD_DIM,
                BLOCK_D)  # fmt: skip
    # dv_x += 2 sum_y dL/dD2 (v_x - v_y), plus for euler the direct dU_x (1 - rowsum W_off).
    grad_v_own -= _row_sums(grad_dist_sum)[:, None] * v_query.to(tl.float32)
    if EULER:
        own_weight = tl.load(OwnWeight + slab * num_queries + rows, mask=rows < num_queries, other=0.0)
        grad_v_own += own_weight[:, None] * grad_out.to(tl.float32)
    _store_rows(GradVOwn + slab * num_queries * VALUE_DIM, rows, num_queries, grad_v_own, VALUE_DIM, BLOCK_DV)


class Launch(NamedTuple):
    """One kernel launch: ``kernel[grid](*args, **meta)``. Built by the same functions for a real launch
    and for tests that compile the kernels ahead of time."""

    kernel: object
    grid: tuple
    args: tuple
    meta: dict


# Calls of at most this many (query, key) pairs, batch and heads included, run each kernel's exact pass alone over
# every block instead of a first pass and the exact pass of the flagged blocks: one Triton launch per kernel instead of
# two. At the paper LM's shape (16 x 8 x 256 x 256 = 2^23) the H100 ran each first pass in 17-26 us and the host took
# 85 us per launch (docs/performance.md), while the exact passes there cost 9-25% more instructions per score at the
# same blocks per SM.
ONE_PASS_PAIRS = 2**23
# Heads of one launch: bit h of an int32 says which of the launch's two p head first + h takes.
MAX_LAUNCH_HEADS = 32


@functools.lru_cache(maxsize=256)  # a model's layers pass the same few tuples at every call
def launch_groups(p):
    """(first head, end, low p, high p, high_heads) of each launch, ``p`` a tuple of one float per head: consecutive
    heads with at most two values of p (the paper's mix is one launch), at most MAX_LAUNCH_HEADS of them; bit h of
    high_heads (a signed int32) is set where head first + h takes the high p. Each p's power class is a compile-time
    constant of the kernels."""
    groups = []  # [first, end, {p}]
    for head, value in enumerate(p):
        if groups and head - groups[-1][0] < MAX_LAUNCH_HEADS and len(groups[-1][2] | {value}) <= 2:
            groups[-1][1] = head + 1
            groups[-1][2].add(value)
        else:
            groups.append([head, head + 1, {value}])
    launches = []
    for first, end, values in groups:
        low, high = min(values), max(values)
        mask = sum(1 << (head - first) for head in range(first, end) if p[head] == high != low)
        launches.append((first, end, low, high, mask - (1 << 32) if mask >= 1 << 31 else mask))
    return tuple(launches)


def _ceil_div(a, b):
    return -(-a // b)


def _slab_blocks(kernel, config, num_queries, num_keys):
    """The blocks of one (batch, head) that ``kernel``'s grid tiles: key blocks for dK/dV, query blocks otherwise."""
    if kernel is _plap_bwd_dkdv_kernel:
        return _ceil_div(num_keys, config.block_n)
    return _ceil_div(num_queries, config.block_m)


def _launches(kernel, config, query, key, value, tensors, p, is_causal, has_key_mask, has_documents, euler, eps,
              exact_only, flag_block=None):  # fmt: skip
    """The launches of ``kernel`` per group of heads, its first pass then its exact pass (or that alone); a backward
    kernel's ``flag_block`` is the size of the forward's blocks (dq) or key tiles (dk/dv) that its flags cover, and
    its row sums take ``config.sums_by_matmul``."""
    batch, heads, num_queries, head_dim = query.shape
    num_keys, value_dim = key.shape[2], value.shape[-1]
    blocks = _slab_blocks(kernel, config, num_queries, num_keys)
    launches = []
    for first, end, low, high, high_heads in launch_groups(tuple(p)):
        meta = dict(HEAD_DIM=head_dim, VALUE_DIM=value_dim, BLOCK_D=padded_head_size(head_dim),
                    BLOCK_DV=padded_head_size(value_dim), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                    POWER_LOW=POWER_CLASSES.get(low, 0), POWER_HIGH=POWER_CLASSES.get(high, 0), IS_CAUSAL=is_causal,
                    HAS_KEY_MASK=has_key_mask, HAS_DOCUMENTS=has_documents, EULER=euler, num_warps=config.num_warps,
                    num_stages=config.num_stages)  # fmt: skip
        if flag_block is not None:
            meta.update(FLAG_BLOCK=flag_block, SUMS_BY_MATMUL=bool(config.sums_by_matmul))
        sizes = (first, end - first, heads, num_queries, num_keys, LOG2_E / math.sqrt(head_dim), (low - 2) / 2,
                 (high - 2) / 2, high_heads, eps)  # fmt: skip
        grid, args = (blocks * batch * (end - first),), (*tensors, *sizes)
        first_pass = dict(meta, EXACT=False)
        if config.max_registers and not (has_key_mask or has_documents):
            first_pass["maxnreg"] = config.max_registers
        exact = Launch(kernel, grid, args, dict(meta, EXACT=True))
        launches += [exact] if exact_only else [Launch(kernel, grid, args, first_pass), exact]
    return launches


def _masks(sq_norms, key_keep, documents):
    """The kernels' KeyKeep and Documents arguments; an absent one is a placeholder tensor never read."""
    return tuple(sq_norms if mask is None else mask for mask in (key_keep, documents))


def squared_norms(value):
    """(..., N) float32 squared norms of the rows of ``value`` (..., N, C), from one read of them: each is the square of
    a float32 norm, within about 1.5 u of the float32 sum of its exact squares (docs/numerics.md)."""
    return torch.linalg.vector_norm(value, dim=-1, dtype=torch.float32).square_()


def forward_launches(query, key, value, sq_norms, key_keep, documents, out, lse, own_weight, exact_blocks, p,
                     is_causal, eps, euler, config, exact_only=False):  # fmt: skip
    """The forward launches of contiguous inputs, the first pass then the exact one (``_plap_fwd_kernel``), or the
    exact one alone (``exact_only``, every flag set); ``key_keep`` is the (B, Nk) int8 padding mask or None,
    ``documents`` the ``document_table`` of packed rows or None, ``sq_norms`` the (B, H, Nk) float32 squared norms of
    the values, ``exact_blocks`` two int32 tensors of ``exact_block_counts(...)`` elements, the second zero (all set
    with ``exact_only``)."""
    tensors = (query, key, value, sq_norms, *_masks(sq_norms, key_keep, documents), out, lse, own_weight,
               *exact_blocks)  # fmt: skip
    flags = (p, is_causal, key_keep is not None, documents is not None, euler, eps, exact_only)
    return _launches(_plap_fwd_kernel, config.fwd, query, key, value, tensors, *flags)


def exact_block_counts(query, key, config):
    """The forward's flags over every (batch, head): one per query block of its grid, which its own passes and dq's
    follow, and one per key tile of its loops, which dk/dv's follow."""
    slabs = query.shape[0] * query.shape[1]
    return slabs * _ceil_div(query.shape[2], config.fwd.block_m), slabs * _ceil_div(key.shape[2], config.fwd.block_n)


def backward_launches(
    query, key, value, sq_norms, key_keep, documents, grad_out, out, lse, delta, own_dot, own_weight, grad_q, grad_k,
    grad_v, grad_v_own, exact_blocks, p, is_causal, eps, euler, config, exact_only=False,
):  # fmt: skip
    """The dq launches, then the dk/dv launches, each kernel's first pass then its exact one (or that alone, as in
    ``forward_launches``). dq writes the row statistics ``delta`` and (euler) ``own_dot``, (B, H, Nq) float32, and
    each query's own-value part of dv to ``grad_v_own``, (B, H, Nq, dv) float32, which the dk/dv kernel adds to the
    key side as it stores ``grad_v``; ``exact_blocks`` are the forward's flags (``forward_launches``)."""
    inputs = (query, key, value, sq_norms, *_masks(sq_norms, key_keep, documents), grad_out, lse, delta, own_dot)
    flags = (p, is_causal, key_keep is not None, documents is not None, euler, eps, exact_only)
    query_blocks, key_tiles = exact_blocks
    dq = (_plap_bwd_dq_kernel, config.dq, query, key, value, (*inputs, out, own_weight, grad_q, grad_v_own,
                                                              query_blocks))  # fmt: skip
    dkdv = (_plap_bwd_dkdv_kernel, config.dkdv, query, key, value, (*inputs, grad_v_own, grad_k, grad_v, key_tiles))
    return _launches(*dq, *flags, config.fwd.block_m) + _launches(*dkdv, *flags, config.fwd.block_n)


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


def document_table(document_ids):
    """(B, N, 3) int32 of packed rows: per token its document (ids renumbered 0, 1, ... in each row, equal where
    ``document_ids`` are equal), and the first and one past the last position of that document's tokens, the
    span that the kernels' loops visit. Tensor operations only (no host reads)."""
    batch, length = document_ids.shape
    sorted_ids, order = document_ids.sort(dim=-1, stable=True)  # equal ids keep their positions' order
    positions = torch.arange(length, device=document_ids.device).expand(batch, length)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    first = order.gather(-1, torch.where(starts, positions, 0).cummax(-1).values)
    last = order.gather(-1, torch.where(ends, positions, length - 1).flip(-1).cummin(-1).values.flip(-1))
    table = torch.stack([starts.cumsum(-1) - 1, first, last + 1], -1)  # in sorted order
    return torch.empty_like(table).scatter_(1, order[..., None].expand_as(table), table).to(torch.int32)


def exact_pass_alone(query, key):
    """Whether a call runs each kernel's exact pass alone (``ONE_PASS_PAIRS``)."""
    return query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2] <= ONE_PASS_PAIRS


def _exact_flags(query, key, config, alone):
    """The forward's int32 flags (``exact_block_counts``): its query blocks', written by its first pass, and its key
    tiles', zero until its exact pass; all set where every kernel runs its exact pass alone."""
    query_blocks, key_tiles = exact_block_counts(query, key, config)
    flags = dict(device=query.device, dtype=torch.int32)
    if alone:
        return torch.ones(query_blocks, **flags), torch.ones(key_tiles, **flags)
    return torch.empty(query_blocks, **flags), torch.zeros(key_tiles, **flags)


def _flat(config):
    """A LaunchConfig as the list of ints a custom op takes."""
    return [number for kernel in config for number in kernel]


def _unflat(numbers):
    size = len(KernelConfig._fields)
    return _config(*(numbers[start : start + size] for start in range(0, 3 * size, size)))


# Forward and backward as custom ops, so that torch.compile and torch.export trace through the kernels as one opaque
# node each way (their fake versions give only the shapes); eager calls run the same two functions without the
# custom-op dispatcher (``FusedOp``). The forward returns what the backward needs.
def _fused_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_keep: torch.Tensor | None,
    documents: torch.Tensor | None,
    p: list[float],
    is_causal: bool,
    eps: float,
    euler: bool,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output, then what the backward needs: the logsumexp, euler's own weights, the values' squared norms and the
    exact passes' flags (``_exact_flags``)."""
    batch, heads, num_queries, _ = query.shape
    out = query.new_empty(batch, heads, num_queries, value.shape[-1])  # (B, H, Nq, dv)
    lse = torch.empty(batch, heads, num_queries, device=query.device, dtype=torch.float32)
    own_weight = torch.empty_like(lse) if euler else lse.new_empty(0)  # written by euler only
    sq_norms = squared_norms(value)  # (B, H, Nk)
    config, alone = _unflat(config), exact_pass_alone(query, key)
    exact_blocks = _exact_flags(query, key, config, alone)
    for launch in forward_launches(
        query, key, value, sq_norms, key_keep, documents, out, lse, own_weight if euler else lse, exact_blocks,
        tuple(p), is_causal, eps, euler, config, alone,
    ):  # fmt: skip
        _run(launch, query, value)
    return out, lse, own_weight, sq_norms, *exact_blocks


_forward_op = torch.library.custom_op(op_name(__name__, "forward"), mutates_args=())(_fused_forward)


@_forward_op.register_fake
def _(query, key, value, key_keep, documents, p, is_causal, eps, euler, config):
    batch, heads, num_queries, _ = query.shape
    lse = query.new_empty(batch, heads, num_queries, dtype=torch.float32)
    flags = (lse.new_empty(count, dtype=torch.int32) for count in exact_block_counts(query, key, _unflat(config)))
    return (query.new_empty(batch, heads, num_queries, value.shape[-1]), lse,
            lse.new_empty(lse.shape if euler else (0,)), lse.new_empty(value.shape[:3]), *flags)  # fmt: skip


def _fused_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_keep: torch.Tensor | None,
    documents: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    own_weight: torch.Tensor,
    sq_norms: torch.Tensor,
    query_blocks: torch.Tensor,
    key_tiles: torch.Tensor,
    p: list[float],
    is_causal: bool,
    eps: float,
    euler: bool,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out = grad_out.contiguous()
    delta = torch.empty(query.shape[:3], device=query.device, dtype=torch.float32)  # written by the dq kernel
    own_dot = torch.empty_like(delta) if euler else delta  # the paper formulation's kernels never read it
    grad_q, grad_k, grad_v = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    grad_v_own = torch.empty(out.shape, device=query.device, dtype=torch.float32)
    config, alone = _unflat(config), exact_pass_alone(query, key)
    for launch in backward_launches(
        query, key, value, sq_norms, key_keep, documents, grad_out, out, lse, delta, own_dot,
        own_weight if euler else lse, grad_q, grad_k, grad_v, grad_v_own, (query_blocks, key_tiles), tuple(p),
        is_causal, eps, euler, config, alone,
    ):  # fmt: skip
        _run(launch, query, value)
    return grad_q, grad_k, grad_v


_backward_op = torch.library.custom_op(op_name(__name__, "backward"), mutates_args=())(_fused_backward)


@_backward_op.register_fake
def _(grad_out, query, key, value, key_keep, documents, out, lse, own_weight, sq_norms, query_blocks, key_tiles, p,
      is_causal, eps, euler, config):  # fmt: skip
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


_fused = FusedOp(_forward_op, _fused_forward, _backward_op, _fused_backward)


def plap_attention_triton(
    query, key, value, *, p, attn_mask=None, is_causal=False, document_ids=None, eps=1e-6, formulation="paper",
    blocks=None, config=None,
):  # fmt: skip
    """p-Laplacian attention with fused kernels; arguments as ``plap_attention``, which checks the inputs and
    ``triton_unsupported_reason`` before it calls this: a direct call is trusted.

    ``p`` is a tuple of floats, one per head (static: each run of equal p is one launch, p = 1.5 and 2.5
    with specialised powers); no gradient for p. ``attn_mask`` must be a key-padding mask (see
    ``triton_unsupported_reason``). ``config`` (a LaunchConfig) overrides the one of the GPU, and ``blocks`` =
    (BLOCK_M, BLOCK_N) the tile sizes of all three kernels (tests cross tile borders with them).
    """
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
    documents = None if document_ids is None else document_table(document_ids)
    query, key, value = (tensor.contiguous() for tensor in (query, key, value))  # offsets follow from shapes
    out, *_ = _fused(query, key, value, key_keep, documents, [float(v) for v in p], is_causal, float(eps),
                               formulation == "euler", _flat(config))  # fmt: skip
    return out
