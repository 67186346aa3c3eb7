"""Fused p-Laplacian attention in Triton, the host side: what a GPU can run, the launches, the custom ops and the entry
point. Same maths and backward as ``plap_attention_tiled`` (see its docstring), with each tile in registers.

The backend's files, in reading order:
- ``triton_configs.py``: each kernel's tiles, warps and stages per GPU generation, input kind and head size;
- ``triton_tiles.py``: what the kernels share (loads, the power, distances and close pairs, masks, loop bounds);
- ``triton_forward.py``: the forward kernel (online softmax, output and logsumexp);
- ``triton_backward.py``: the dQ kernel, then the dK/dV kernel;
- ``triton_launcher.py``: launches bound to what Triton compiled, or traced for Inductor;
- this module.

Each kernel runs twice over its grid (``EXACT``): a first pass with the distances' expansion alone, then an exact
pass over the blocks that have close pairs of values (``triton_tiles.distances``). The forward's first pass finds
them: a block that meets one stores only a flag. Its exact pass redoes those blocks and flags each key tile in which
it met one, so that the backward's passes split their blocks by the forward's flags (dq by query, dk/dv by key)
without a test of their own in the first pass. The close pairs' direct differences take code and registers that
would cut the blocks per SM to one. Calls of at most ``ONE_PASS_PAIRS`` pairs run the exact pass alone, every block
flagged: one launch per kernel, where the GPU would wait for the host's launches rather than for the kernels. The
values' norms, float32, are computed before the forward by one ATen reduction that reads the values once; the
kernels square them.

P = (D2 + eps) ** ((p - 2) / 2) uses the hardware's approximate special functions (relative error ~2^-22): p = 1.5
and 2.5 as square-root chains, any other p as exp2(e * log2(x)). A run of up to 32 consecutive heads with at most two
values of p (each program reads its head's p from a bit mask) is one launch per kernel pass, the power's class a
compile-time constant of the launch; the paper's mix, whose two p take two chains, is one launch where the call's
exact pass runs alone (small calls, which wait for the host: the chains join at two instructions per score) and one
launch per p in the two passes of larger ones (``launch_groups``). Each loop runs in two parts: plain
tiles, whose pairs are all allowed and off the diagonal, with no mask and no self-pair test, then the few masked
tiles (the diagonal band, the last partial tile, every tile under key padding).

P and every accumulation are float32. Matmuls of half-precision operands take them as they are (exact products). No
matmul with a float32 operand runs in plain TF32, whose inputs keep 10 mantissa bits: for float32 inputs every matmul
is tf32x3, v_x.v_y of D2 included; for half inputs the float32 operand is the distance gradient Gd of Gd V and Gd^T
V_q (``triton_tiles.exact_dot``). Masks: causal (bottom-right aligned) and key padding (a boolean mask broadcastable
to (B, 1, 1, Nk)); the dispatcher routes other masks to the tiled backend. Packed rows (``document_ids``, Nq == Nk)
are varlen: each fixed block's loop visits only the span of positions its documents cover. Lengths need not be
multiples of the blocks. The kernels take q, k, v and the output by their (batch, head, row) strides, columns
contiguous: the views of a model's projections, tokens-major, reach them with no copy, the output takes the queries'
order (so that a model's reshape of it is a view), the gradients their inputs' layouts, and dU arrives in the output's
(``kernel_layout``, ``output_like``). No gradient for p (static per head).

What a GPU can run is decided before any launch, by ``triton_unsupported_reason``: the Triton version, the compute
capability, dtypes, head sizes per dtype and architecture (so that the tiles fit its shared memory), mask shapes and
element counts. ``tests/attention/test_triton_compile.py`` compiles a sample of the configurations it admits for each
supported architecture on CPU, and all of them with ``-m kernels``. A compile or launch failure that still happens is
re-raised with the configuration and a pointer to the tiled backend, never replaced silently.
"""

import functools
import math
from typing import NamedTuple

import torch

from .custom_ops import FusedOp, op_name
from .eager_cache import eager_cache
from .head_runs import head_runs
from .plap_attention_reference import formulation_of, implemented
from .triton_backward import plap_dkdv_kernel, plap_dq_kernel
from .triton_configs import (
    SUPPORTED_DTYPES, KernelConfig, LaunchConfig, capability_reason, device_capability,
    interpreter_config, launch_config, padded_head_size,
)  # fmt: skip
from .triton_forward import plap_forward_kernel
from .triton_launcher import TRITON_VERSION, BoundLaunches, PlanKey, on_device, run_launch, traced_launch
from .triton_tiles import (
    EXACT_ALONE, EXACT_PASS, FIRST_PASS, INTERPRETED, POWER_ANY, POWER_QUARTERS, QUARTER_CLASSES, triton,
)  # fmt: skip

# Oldest Triton whose compiled kernels are checked (tests/attention/test_triton_compile.py with PLAT_AOT_TRITON; older
# ones do not compile the kernels' tuple arguments).
MIN_TRITON_VERSION = (3, 5)
# Offsets inside one (batch, head) slab and program ids are int32; the slab bases are int64.
MAX_OFFSET = 2**31 - 1
# The kernels multiply the weights A * P, cast to the inputs' dtype, with the values in half-precision matmuls.
# For p <= 3, P = (|v_x - v_y|^2 + eps)^((p - 2) / 2) is at most about the value distance itself; for larger p
# it can pass float16's largest value (65,504) with ordinary activations (at p = 4, distances above 256).
FLOAT16_MAX_P = 3.0
# exp(x) = exp2(x * LOG2_E): the kernels' scores are in log2 units, log2(e) / sqrt(d) folded into one scale.
LOG2_E = 1.4426950408889634
FORMULATIONS = implemented("paper", "euler")


def triton_unsupported_reason(query, key=None, value=None, *, p, attn_mask=None, is_causal=False, sliding_window=None,
                              document_ids=None, formulation="paper", device_type=None, capability=None):  # fmt: skip
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
        return f"formulation {formulation!r} is not one of {tuple(FORMULATIONS)}"
    if sliding_window is not None and not is_causal:
        return "a sliding window is fused with causal masking only (keys in (x - window, x])"
    if device_type == "cuda":
        capability = device_capability(query.device.index) if capability is None else capability
        reason = capability_reason(capability, query.dtype, query.shape[-1], value.shape[-1])
    elif device_type == "cpu" and INTERPRETED:
        reason = None  # the interpreter has no architecture limits
    else:
        reason = (
            f"the kernels need CUDA tensors, got {device_type} (CPU tensors run only under the Triton "
            "interpreter, TRITON_INTERPRET=1 set before import)"
        )
    return reason or _input_reason(query, key, value, attn_mask, document_ids, max(p, default=None))


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
    # Offsets inside one (batch, head) slab are int32: rows * d where the rows are contiguous, as ``kernel_layout``
    # makes them where their strides would pass that.
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



class Launch(NamedTuple):
    """One kernel launch: ``kernel[grid](*args, **meta)``. Built by the same functions for a real launch
    and for tests that compile the kernels ahead of time. ``args`` are ``tensors`` tensors, then the scalars of
    ``plan`` (``_launch_plan``), which holds everything of the launch but its tensors."""

    kernel: object
    grid: tuple
    args: tuple
    meta: dict
    tensors: int = 0
    plan: PlanKey | None = None


# Calls of at most this many (query, key) pairs, batch and heads included, run each kernel's exact pass alone over
# every block instead of a first pass and the exact pass of the flagged blocks: half the launches, and no flags. At the
# paper LM's shape (16 x 8 x 256 x 256 = 2^23) an H100 ran each first pass in 17-26 us, less than the host's launch,
# while an exact pass costs the blocks without close pairs only some more arithmetic.
ONE_PASS_PAIRS = 2**23
# Multiply-adds fused (FMA): the kernels' arithmetic and instruction counts assume them, and Triton's default turns
# fusion off from 3.10.
FP_FUSION = True
# Runs of heads: bit h of an int32 says which of the run's two p head first + h takes.
MAX_LAUNCH_HEADS = 32


@functools.lru_cache(maxsize=256)  # a model's layers pass the same few tuples at every call
def launch_groups(p, merge_quarters):
    """(first head, end, power class, low p, high p, high_heads) of each launch, ``p`` a tuple of one float per head:
    runs of at most MAX_LAUNCH_HEADS consecutive heads with at most two values of p, bit h of high_heads (a signed
    int32) set where head first + h takes the high p. A run is one launch, its class a compile-time constant: any p's
    class, or where its p are the paper's, the class of its one p, or with both (the paper's mix) POWER_QUARTERS where
    ``merge_quarters``, else one launch per p with the class of each, whose programs run that p's heads only
    (``triton_tiles.runs_head``)."""
    launches = []
    for first, end in head_runs(p, lambda run: len(run) <= MAX_LAUNCH_HEADS and len(set(run)) <= 2):
        values = sorted(set(p[first:end]))
        mask = sum(1 << (head - first) for head in range(first, end) if p[head] == values[-1] != values[0])
        if not set(values) <= set(QUARTER_CLASSES):
            classes = [POWER_ANY]
        elif len(values) == 2 and merge_quarters:
            classes = [POWER_QUARTERS]
        else:
            classes = [QUARTER_CLASSES[value] for value in values]
        launches += [(first, end, int(power), values[0], values[-1], mask - (1 << 32) if mask >= 1 << 31 else mask)
                     for power in classes]  # fmt: skip
    return tuple(launches)


def _ceil_div(a, b):
    return -(-a // b)


def _slab_blocks(kernel, config, num_queries, num_keys):
    """The blocks of one (batch, head) that ``kernel``'s grid tiles: key blocks for dK/dV, query blocks otherwise."""
    if kernel is plap_dkdv_kernel:
        return _ceil_div(num_keys, config.block_n)
    return _ceil_div(num_queries, config.block_m)


def _fixed_block(kernel):
    """The KernelConfig field of a backward kernel's fixed block: dK/dV's keys, dQ's queries."""
    return "block_n" if kernel is plap_dkdv_kernel else "block_m"


def _passes(kernel, config, exact_only):
    """(PASS, KernelConfig) of each launch of a kernel's heads: its first pass then its exact pass, or that alone; a
    backward kernel's exact pass with its own fixed block where ``config.exact_block`` gives one."""
    exact = config
    if config.exact_block:
        fixed = _fixed_block(kernel)
        if kernel is plap_forward_kernel or getattr(config, fixed) % config.exact_block:
            raise ValueError(f"exact_block={config.exact_block} must divide a backward kernel's fixed block: {config}")
        exact = config._replace(**{fixed: config.exact_block}, exact_block=0)
    if exact_only:
        return ((EXACT_ALONE, exact),)
    return (FIRST_PASS, config), (EXACT_PASS, exact)


def _launch_plan(kernel, config, shape, strides, p, is_causal, window, has_key_mask, has_documents, euler, eps,
                 exact_only, flag_block, keyed):  # fmt: skip
    """(kernel, grid, scalar arguments, meta, PlanKey) of each launch of ``kernel`` (``launch_groups``), its first pass
    then its exact pass (or that alone, ``_passes``): what the shapes and layouts settle (``call_plan``; no PlanKey
    unless ``keyed``). ``shape`` is (B, H, Nq, Nk, d, dv), ``strides`` those of q, k, v and the output
    (``kernel_strides``), ``window`` the sliding window's size (0: none); a backward kernel's ``flag_block`` is the
    size of the forward's blocks (dq) or key tiles (dk/dv) that its flags cover."""
    batch, heads, num_queries, num_keys, head_dim, value_dim = shape
    slab_strides, (q_rows, k_rows, v_rows, out_rows) = strides
    plan = []
    for first, end, power, low, high, high_heads in launch_groups(p, exact_only):
        # The row statistics' second plane (euler's own weights) starts batch * heads * num_queries in.
        sizes = (first, end - first, heads, num_queries, num_keys, window, LOG2_E / math.sqrt(head_dim),
                 (low - 2) / 2, (high - 2) / 2, high_heads, eps, batch * heads * num_queries,
                 *slab_strides)  # fmt: skip
        for pass_id, tiles in _passes(kernel, config, exact_only):
            meta = dict(HEAD_DIM=head_dim, VALUE_DIM=value_dim, BLOCK_D=padded_head_size(head_dim),
                        BLOCK_DV=padded_head_size(value_dim), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                        POWER=power, IS_CAUSAL=is_causal, HAS_WINDOW=window > 0,
                        HAS_KEY_MASK=has_key_mask, HAS_DOCUMENTS=has_documents, EULER=euler,
                        HEAD_CHUNK=config.head_chunk, num_warps=config.num_warps,
                        num_stages=config.num_stages, enable_fp_fusion=FP_FUSION, Q_ROW_STRIDE=q_rows,
                        K_ROW_STRIDE=k_rows, V_ROW_STRIDE=v_rows, OUT_ROW_STRIDE=out_rows)  # fmt: skip
            if flag_block is not None:
                meta.update(FLAG_BLOCK=flag_block, PASS_BLOCK=getattr(config, _fixed_block(kernel)),
                            SUMS_BY_MATMUL=bool(config.sums_by_matmul))  # fmt: skip
            meta["PASS"] = int(pass_id)
            if pass_id == FIRST_PASS and config.max_registers and not (has_key_mask or has_documents):
                meta["maxnreg"] = config.max_registers
            grid = (_slab_blocks(kernel, tiles, num_queries, num_keys) * batch * (end - first),)
            plan.append((kernel, grid, sizes, meta, PlanKey((kernel, grid, sizes, tuple(meta.items()))) if keyed
                         else None))  # fmt: skip
    return tuple(plan)


class CallPlan(NamedTuple):
    """The launches of a call's three kernels but their tensors (``call_plan``): per launch its kernel, grid, scalar
    arguments, meta and PlanKey, as ``_launch_plan`` gives them."""

    forward: tuple
    dq: tuple
    dkdv: tuple


def call_plan(query, key, value, out, p, is_causal, window, has_key_mask, has_documents, euler, eps, config,
              exact_only):  # fmt: skip
    """The ``CallPlan`` of q, k, v and the output (B, H, N, C) in any ``kernel_layout``, by their shapes and strides
    and the call's other facts (``forward_launches``): computed once per such facts in eager calls. Symbolic sizes
    (torch.compile with dynamic shapes) are not hashable: they get no PlanKeys."""
    shapes = (query.shape, key.shape, value.shape, out.shape)
    strides = (query.stride(), key.stride(), value.stride(), out.stride())
    keyed = type(sum(map(sum, shapes + strides))) is int  # a sum with a symbolic size is symbolic
    facts = (shapes, strides, tuple(p), is_causal, window, has_key_mask, has_documents, euler, eps, config, exact_only)
    return (_call_plan if keyed else _call_plan.__wrapped__)(*facts, keyed)


@eager_cache
def _call_plan(shapes, strides, p, is_causal, window, has_key_mask, has_documents, euler, eps, config, exact_only,
               keyed):  # fmt: skip
    (batch, heads, num_queries, head_dim), key_shape, value_shape, _ = shapes
    layout = ((batch, heads, num_queries, key_shape[2], head_dim, value_shape[3]), kernel_strides(shapes, strides))
    flags = (p, is_causal, window, has_key_mask, has_documents, euler, eps, exact_only)
    return CallPlan(_launch_plan(plap_forward_kernel, config.fwd, *layout, *flags, None, keyed),
                    _launch_plan(plap_dq_kernel, config.dq, *layout, *flags, config.fwd.block_m, keyed),
                    _launch_plan(plap_dkdv_kernel, config.dkdv, *layout, *flags, config.fwd.block_n, keyed))  # fmt: skip


def _bound(planned, tensors):
    """The Launches of ``planned`` launches (a ``CallPlan`` field) on these tensors."""
    return [Launch(kernel, grid, (*tensors, *sizes), meta, len(tensors), key)
            for kernel, grid, sizes, meta, key in planned]  # fmt: skip


def kernel_strides(shapes, strides):
    """The strides of (B, H, N, C) tensors of these shapes and strides, in elements, as the kernels take them
    (``triton_tiles.slab_rows``): each one's batch and head strides, arguments, then each one's row stride, compile-time
    constants (d or H * d, fixed by a model's layout, with no length in them; C for a single row), so that the row
    offsets compile as they did when the rows were contiguous."""
    slabs = tuple(stride for one in strides for stride in one[:2])
    rows = tuple(int(one[2]) if length > 1 else columns for (_, _, length, columns), one in zip(shapes, strides))
    return slabs, rows


def kernel_layout(tensor):
    """``tensor`` (B, H, N, C) as the kernels take it: as it is where its columns are contiguous, its elements dense
    (so that ``empty_like`` gives its gradient the same strides) and one (batch, head)'s rows within int32 offsets,
    else a contiguous copy. The views of a model's projections, (B, N, H, C) transposed, qualify: no copy."""
    return tensor if tensor.is_contiguous() or _strided_ok(tensor.shape, tensor.stride()) else tensor.contiguous()


def output_like(query, value):
    """The (B, H, Nq, dv) output, in the queries' order of heads and tokens: tokens-major, heads inside, for the
    projections' views that models pass (so that their ``transpose(1, 2).reshape(B, N, H * dv)`` is a view), else
    contiguous; contiguous too where tokens-major rows would pass int32 offsets."""
    batch, heads, num_queries, _ = query.shape
    value_dim = value.shape[-1]
    if (not query.is_contiguous() and query.stride(1) < query.stride(2)
            and (num_queries - 1) * heads * value_dim + value_dim <= MAX_OFFSET):  # fmt: skip
        return query.new_empty(batch, num_queries, heads, value_dim).transpose(1, 2)
    return query.new_empty(batch, heads, num_queries, value_dim)


def in_layout_of(out, grad_out):
    """``grad_out`` with the strides of ``out`` (the kernels read both by the output's, ``kernel_strides``): as it is
    where they match, as a model's backward passes it, else copied."""
    strides, grad_strides = out.stride(), grad_out.stride()
    if strides == grad_strides or all(a == b for size, a, b in zip(out.shape, strides, grad_strides) if size > 1):
        return grad_out
    return torch.empty_like(out).copy_(grad_out)


@eager_cache
def _strided_ok(shape, strides):
    _, heads, rows, columns = shape
    if strides[3] != 1 or (rows - 1) * strides[2] + columns > MAX_OFFSET:
        return False
    if strides[1] == columns and strides[2] == heads * columns and strides[0] == rows * strides[2]:
        return True  # (B, N, H, C) memory, as a model's projections leave q, k and v: dense, told at once
    # (stride, size) of the dims of size > 1 by increasing stride, inserted one by one: torch.compile traces the
    # comparisons of symbolic strides (dynamic shapes) here, but not sorted() on them.
    dims = []
    for size, stride in zip(shape, strides):
        if size > 1:
            at = len(dims)
            while at and dims[at - 1][0] > stride:
                at -= 1
            dims.insert(at, (stride, size))
    inside = 1  # dense: from the innermost dim out, each stride is the number of elements inside it (size-1 dims aside)
    for stride, size in dims:
        if stride != inside:
            return False
        inside *= size
    return True


def _masks(norms, key_keep, documents):
    """The kernels' KeyKeep and Documents arguments. An absent one is never read, and gets the values' norms, as every
    tensor argument that a kernel does not use does: no kernel writes them. A placeholder must not alias a tensor that
    the kernel writes: torch.compile's functionalization of a kernel clones each argument that it may write (all of
    them where its analysis of the kernel fails) and copies the clones back in turn, so that the clone of an untouched
    alias would overwrite what the kernel wrote."""
    return (norms if key_keep is None else key_keep), (norms if documents is None else documents)


def value_norms(value):
    """(..., N) float32 norms of the rows of ``value`` (..., N, C), from one read of them; the kernels square them
    (``triton_tiles.squared_norms`` and ``distances``), each square within about 1.5 u of the float32 sum of its exact
    squares (docs/numerics.md). Contiguous whatever the values' layout, as the kernels index them: a reduction's
    result follows its input's layout, so that a projection's view writes into a contiguous tensor."""
    if value.is_contiguous():
        return torch.linalg.vector_norm(value, dim=-1, dtype=torch.float32)
    norms = value.new_empty(value.shape[:-1], dtype=torch.float32)
    return torch.linalg.vector_norm(value, dim=-1, dtype=torch.float32, out=norms)


def forward_launches(query, key, value, norms, key_keep, documents, out, row_stats, exact_blocks, p, is_causal, eps,
                     euler, config, exact_only=False, window=0):  # fmt: skip
    """The forward launches, the first pass then the exact one (``plap_forward_kernel``), or the exact one alone
    (``exact_only``); q, k, v and ``out`` (B, H, N, C) in any ``kernel_layout``, ``key_keep`` the (B, Nk) int8
    padding mask or None, ``documents`` the ``document_table`` of packed rows or None, ``norms`` the (B, H, Nk)
    float32 norms of the values, ``row_stats`` the (1 + euler, B, H, Nq) float32 row statistics that it writes (the
    logsumexp, then euler's own weights: one tensor, never two views of one, which torch.compile's functionalization
    of the kernels' writes does not reliably keep apart), ``exact_blocks`` two int32 tensors of
    ``exact_block_counts(...)`` elements (not read with ``exact_only``), ``window`` the size of a causal sliding window
    (keys in (x - window, x] of the query at key position x; 0: none)."""
    plan = call_plan(query, key, value, out, p, is_causal, window, key_keep is not None, documents is not None, euler,
                     eps, config, exact_only)  # fmt: skip
    return _bound(plan.forward, (query, key, value, norms, *_masks(norms, key_keep, documents), out, row_stats,
                                 *exact_blocks))  # fmt: skip


def exact_block_counts(query, key, config):
    """The forward's flags over every (batch, head): one per query block of its grid, which its own passes and dq's
    follow, and one per key tile of its loops, which dk/dv's follow."""
    slabs = query.shape[0] * query.shape[1]
    return slabs * _ceil_div(query.shape[2], config.fwd.block_m), slabs * _ceil_div(key.shape[2], config.fwd.block_n)


def backward_launches(
    query, key, value, norms, key_keep, documents, grad_out, out, row_stats, delta, own_dot, grad_q, grad_k, grad_v,
    grad_v_own, exact_blocks, p, is_causal, eps, euler, config, exact_only=False, window=0,
):  # fmt: skip
    """The dq launches, then the dk/dv launches, each kernel's first pass then its exact one (or that alone, as in
    ``forward_launches``). dq writes the row statistics ``delta`` and (euler) ``own_dot``, (B, H, Nq) float32, and
    each query's own-value part of dv to ``grad_v_own``, (B, H, Nq, dv) float32, which the dk/dv kernel adds to the
    key side as it stores ``grad_v``; ``exact_blocks`` are the forward's flags (``forward_launches``). ``grad_q``,
    ``grad_k`` and ``grad_v`` have the strides of q, k and v, ``grad_out`` those of ``out`` (``in_layout_of``)."""
    plan = call_plan(query, key, value, out, p, is_causal, window, key_keep is not None, documents is not None, euler,
                     eps, config, exact_only)  # fmt: skip
    inputs = (query, key, value, norms, *_masks(norms, key_keep, documents), grad_out, row_stats, delta, own_dot)
    query_blocks, key_tiles = exact_blocks
    return (_bound(plan.dq, (*inputs, out, grad_q, grad_v_own, query_blocks))
            + _bound(plan.dkdv, (*inputs, grad_v_own, grad_k, grad_v, key_tiles)))  # fmt: skip


_BOUND = BoundLaunches()


def _run(launch, query, value):
    """Launch: bound to the compiled kernel on plain tensors, through ``wrap_triton`` while torch.compile traces."""
    run_launch(launch, query, value, _BOUND if type(query) in (torch.Tensor, torch.nn.Parameter) else traced_launch)


def _run_all(launches, query, value):
    """A call's launches, on its inputs' GPU (``on_device``)."""
    with on_device(query.device):
        for launch in launches:
            _run(launch, query, value)


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
    tiles', zeroed by its first pass and set by its exact pass; none where every kernel runs its exact pass alone.
    torch.empty, not new_empty: AOTAutograd's common-subexpression pass merges equal new_empty calls (it leaves empty
    alone), and with as many blocks as tiles both flags were one tensor under torch.compile, which then copied one."""
    counts = (0, 0) if alone else exact_block_counts(query, key, config)
    return tuple(torch.empty(count, dtype=torch.int32, device=query.device) for count in counts)


@eager_cache
def _kernel_arguments(p, eps, formulation, dtype, head_dim, value_dim, capability, blocks, config):
    """The fused ops' plain arguments that a call's static facts settle: p (a list, as the ops take it), eps, whether
    the formulation is euler, and the launch configuration as ints (``_flat``): ``config``, or the one of the GPU of
    this compute ``capability`` (the interpreter's where None), with the tiles ``blocks`` where given."""
    euler = formulation_of(formulation, FORMULATIONS, "triton").self_pair == "euler"
    if config is None and capability is not None:
        config = launch_config(dtype, head_dim, value_dim, capability)
    elif config is None:
        config = interpreter_config(dtype, head_dim, value_dim)
    if blocks is not None:
        config = config.with_blocks(*blocks)
    return list(map(float, p)), eps, euler, _flat(config)


@eager_cache
def _flat(config):
    """A LaunchConfig as the ints a custom op takes (its ``int[]``)."""
    return tuple(int(number) for kernel in config for number in kernel)


def _unflat(numbers):
    """The LaunchConfig of a custom op's list of ints (``_flat``), built once per configuration."""
    return _config_of(tuple(numbers))


@eager_cache
def _config_of(numbers):
    size = len(KernelConfig._fields)
    return LaunchConfig(*(KernelConfig(*numbers[start : start + size]) for start in range(0, 3 * size, size)))


# Forward and backward as ops that torch.compile traces; eager calls run the same two functions without the ops'
# dispatcher (``FusedOp``). On a GPU they are ``triton_op``s: Inductor traces into them and launches the kernels itself
# (``_run``). Under the interpreter, whose kernels Inductor cannot take, opaque custom ops whose fake versions give the
# shapes. The forward returns what the backward needs.
_TRACED_KERNELS = not INTERPRETED and hasattr(torch.library, "triton_op")


def _fused_op(name, function, fake):
    if _TRACED_KERNELS:
        return torch.library.triton_op(op_name(__name__, name), function, mutates_args=())
    op = torch.library.custom_op(op_name(__name__, name), function, mutates_args=())
    op.register_fake(fake)
    return op


def forward_plan(query, key, value, key_keep, documents, p, is_causal, window, eps, euler, config, alone):
    """The forward's outputs, allocated, and the launches that write them: the output, then what the backward needs,
    the row statistics (``forward_launches``), the values' norms and the exact passes' flags (``_exact_flags``);
    ``alone``: each kernel runs its exact pass alone (``exact_pass_alone``)."""
    batch, heads, num_queries, _ = query.shape
    out = output_like(query, value)
    row_stats = torch.empty(1 + euler, batch, heads, num_queries, device=query.device, dtype=torch.float32)
    norms = value_norms(value)  # (B, H, Nk)
    exact_blocks = _exact_flags(query, key, config, alone)
    launches = forward_launches(query, key, value, norms, key_keep, documents, out, row_stats, exact_blocks, tuple(p),
                                is_causal, eps, euler, config, alone, window)  # fmt: skip
    return (out, row_stats, norms, *exact_blocks), launches


def _fused_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_keep: torch.Tensor | None,
    documents: torch.Tensor | None,
    p: list[float],
    is_causal: bool,
    window: int,
    eps: float,
    euler: bool,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``forward_plan``'s outputs, its launches run."""
    outputs, launches = forward_plan(query, key, value, key_keep, documents, p, is_causal, window, eps, euler,
                                     _unflat(config), exact_pass_alone(query, key))  # fmt: skip
    _run_all(launches, query, value)
    return outputs


def _fake_forward(query, key, value, key_keep, documents, p, is_causal, window, eps, euler, config):
    batch, heads, num_queries, _ = query.shape
    return (output_like(query, value),
            query.new_empty(1 + euler, batch, heads, num_queries, dtype=torch.float32),
            query.new_empty(value.shape[:3], dtype=torch.float32),
            *_exact_flags(query, key, _unflat(config), exact_pass_alone(query, key)))  # fmt: skip


def backward_plan(grad_out, query, key, value, key_keep, documents, out, row_stats, norms, query_blocks, key_tiles,
                  p, is_causal, window, eps, euler, config, alone):  # fmt: skip
    """The gradients of query, key and value, allocated, and the launches that write them, from the forward's inputs
    and ``forward_plan``'s outputs."""
    delta = torch.empty(query.shape[:3], device=query.device, dtype=torch.float32)  # written by the dq kernel
    own_dot = torch.empty_like(delta) if euler else norms  # never read by the paper formulation (``_masks``)
    grad_q, grad_k, grad_v = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    grad_v_own = torch.empty(out.shape, device=query.device, dtype=torch.float32)
    launches = backward_launches(
        query, key, value, norms, key_keep, documents, grad_out, out, row_stats, delta, own_dot, grad_q, grad_k, grad_v,
        grad_v_own, (query_blocks, key_tiles), tuple(p), is_causal, eps, euler, config, alone, window,
    )  # fmt: skip
    return (grad_q, grad_k, grad_v), launches


def _fused_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_keep: torch.Tensor | None,
    documents: torch.Tensor | None,
    out: torch.Tensor,
    row_stats: torch.Tensor,
    norms: torch.Tensor,
    query_blocks: torch.Tensor,
    key_tiles: torch.Tensor,
    p: list[float],
    is_causal: bool,
    window: int,
    eps: float,
    euler: bool,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backward_plan``'s gradients, its launches run."""
    grads, launches = backward_plan(in_layout_of(out, grad_out), query, key, value, key_keep, documents, out, row_stats,
                                    norms, query_blocks, key_tiles, p, is_causal, window, eps, euler, _unflat(config),
                                    exact_pass_alone(query, key))  # fmt: skip
    _run_all(launches, query, value)
    return grads


def _fake_backward(grad_out, query, key, value, key_keep, documents, out, row_stats, norms, query_blocks, key_tiles,
                   p, is_causal, window, eps, euler, config):  # fmt: skip
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


_forward_op = _fused_op("forward", _fused_forward, _fake_forward)
_backward_op = _fused_op("backward", _fused_backward, _fake_backward)
_fused = FusedOp(_forward_op, _fused_forward, _backward_op, _fused_backward)


def plap_attention_triton(
    query, key, value, *, p, attn_mask=None, is_causal=False, sliding_window=None, document_ids=None, eps=1e-6,
    formulation="paper", blocks=None, config=None,
):  # fmt: skip
    """p-Laplacian attention with fused kernels; arguments as ``plap_attention``, which checks the inputs and
    ``triton_unsupported_reason`` before it calls this: a direct call is trusted.

    ``p`` is a tuple of floats, one per head (static: each run of equal p is one launch, p = 1.5 and 2.5
    with specialised powers); no gradient for p. ``attn_mask`` must be a key-padding mask (see
    ``triton_unsupported_reason``). ``sliding_window`` (with ``is_causal``): the query at key position x attends to
    the keys in (x - sliding_window, x], as transformers defines the window; the loops visit only those tiles.
    ``config`` (a LaunchConfig) overrides the one of the GPU, and ``blocks`` = (BLOCK_M, BLOCK_N) the tile sizes of
    all three kernels (tests cross tile borders with them).
    """
    capability = device_capability(query.device.index) if query.device.type == "cuda" else None
    arguments = _kernel_arguments(tuple(p), float(eps), formulation, query.dtype, query.shape[-1], value.shape[-1],
                                  capability, blocks, config)  # fmt: skip
    key_keep = None
    if attn_mask is not None:
        batch, num_keys = query.shape[0], key.shape[2]
        key_keep = attn_mask.reshape(_key_padding_shape(attn_mask)).expand(batch, num_keys)
        key_keep = key_keep.to(torch.int8).contiguous()  # (B, Nk)
    documents = None if document_ids is None else document_table(document_ids)
    query, key, value = kernel_layout(query), kernel_layout(key), kernel_layout(value)
    # A window as long as the keys leaves every causal pair: no window then.
    window = sliding_window if sliding_window is not None and sliding_window < key.shape[2] else 0
    p, eps, euler, config = arguments
    out, *_ = _fused(query, key, value, key_keep, documents, p, is_causal, window, eps, euler, config)
    return out
