"""Launch configurations of the fused Triton kernels: each kernel's tiles, warps and pipeline stages, per GPU generation,
input kind and padded head size, in one table (``CONFIGS``), and what a GPU's shared memory admits.

Each of the three kernels (``triton_forward``, ``triton_backward``) holds one block of rows fixed and loops over the
other side's blocks: the forward and dQ kernels a block of ``block_m`` queries against tiles of ``block_n`` keys, the
dK/dV kernel a block of ``block_n`` keys against tiles of ``block_m`` queries. Larger blocks reuse more of each load;
smaller ones fit more programs per SM. The table's entries were chosen by compiling every candidate ahead of time
(registers, spills, shared memory) and counting the instructions of its main loop; ``tests/attention/test_triton_compile.py``
compiles each admitted configuration for the GPUs it names.
"""

from typing import NamedTuple

import torch
from transformers.utils import logging

from .eager_cache import eager_cache

logger = logging.get_logger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest opt-in shared memory per block (bytes) of the compute capabilities the kernels are compiled and checked for
# (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": 163 KB on 8.0 and 8.7, 99 KB on 8.6,
# 8.9, 12.0 and 12.1, 227 KB on 9.0, 10.0 and 10.3).
SHARED_MEMORY_LIMIT = {
    (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (10, 3): 232448,
    (12, 0): 101376, (12, 1): 101376,
}  # fmt: skip
# The kernels' matmuls take bfloat16 operands (tensor-core instructions from sm_80 on), and their tiles are checked from
# sm_80 on.
MIN_CAPABILITY = (8, 0)
# The table (a generation of CONFIGS) of each family of checked compute capabilities, by major version: 12.x (RTX 50xx,
# GB10; mma.sync like Ampere, 99 KB) runs the 8.x tiles. A compute capability from 8.0 on that SHARED_MEMORY_LIMIT does
# not list runs CONSERVATIVE_TABLE, sized for 99 KB, the least shared memory of the checked GPUs, not checked for it.
FAMILY_TABLES = {8: 8, 9: 9, 10: 10, 12: 8}
CONSERVATIVE_TABLE = 8


class KernelConfig(NamedTuple):
    """How one kernel is launched.

    block_m         queries per tile (the fixed block of the forward and dQ kernels, a loop tile of dK/dV)
    block_n         keys per tile (the loop tile of the forward and dQ kernels, the fixed block of dK/dV)
    num_warps       warps per program
    num_stages      Triton's software-pipeline stages: loads of the next tile in flight during this one
    max_registers   ptxas's register cap per thread (0: its own choice), so that more programs fit an SM; applied
                    to first passes without key padding or packed documents (whose branches, like the exact
                    passes, hold more and would spill in the loop)
    sums_by_matmul  the backward's row sums of the distance gradient against bfloat16 values: from a matmul of its
                    bfloat16 parts against ones (True), or summed in each thread (False), where the parts' second
                    matmul layout would spill (sm_80 family at head size 128)
    head_chunk      columns per step of the products over the head sizes whose operands the kernel reloads in each
                    tile, its fixed block's rows included (0: fixed rows held in registers): float32 above 64
    exact_block     a backward kernel's exact pass's fixed block (dK/dV's keys, dQ's queries) where it is smaller
                    than the first pass's, which it divides (0: the first pass's): the exact pass holds more in its
                    loop and spills at blocks that the first pass keeps in registers. It then runs the first pass's
                    flagged blocks in pieces of this size (``triton_tiles.pass_block_start``)
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2
    max_registers: int = 0
    sums_by_matmul: bool = True
    head_chunk: int = 0
    exact_block: int = 0


class LaunchConfig(NamedTuple):
    """One KernelConfig per kernel."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig

    def with_blocks(self, block_m, block_n):
        """Every kernel, each pass, with these tiles."""
        return LaunchConfig(*(config._replace(block_m=block_m, block_n=block_n, exact_block=0) for config in self))


K = KernelConfig
# float32 at head sizes 128 and 256 on every generation: the largest tiles and chunks that spill nothing inside their
# loops with Triton 3.9 (tools/kernels/README.md, "float32 above 64").
_CHUNKED = dict(num_warps=8, num_stages=1, head_chunk=32)
FLOAT32_CHUNKED = {
    128: LaunchConfig(fwd=K(32, 16, **_CHUNKED), dkdv=K(16, 16, **_CHUNKED), dq=K(32, 16, **_CHUNKED)),
    256: LaunchConfig(fwd=K(16, 16, **_CHUNKED), dkdv=K(16, 16, **dict(_CHUNKED, head_chunk=16)),
                      dq=K(16, 16, **dict(_CHUNKED, head_chunk=16))),
}
# By GPU generation (8: Ampere and Ada, sized for sm_86/sm_89's 99 KB of shared memory, also run by 12.x and by unknown
# compute capabilities, FAMILY_TABLES; 9: Hopper; 10: B200 / B300), input kind and padded head size
# (``padded_head_size``). A head size above a table's largest entry has no configuration. The entries at head size 256
# and those of 10.x are the largest tiles whose kernels (first and exact passes, every optional branch, each power
# class) spill nothing inside their main loop with Triton 3.9's and 3.6's ptxas and fit the table's least shared
# memory; tools/kernels/README.md, "Launch configurations".
CONFIGS = {
    (8, "half"): {
        16: LaunchConfig(fwd=K(128, 64, num_warps=8), dkdv=K(32, 128, num_warps=8), dq=K(128, 32, num_warps=8)),
        32: LaunchConfig(fwd=K(128, 32, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(128, 32, num_warps=8)),
        64: LaunchConfig(fwd=K(128, 32, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(128, 16, num_warps=8)),
        # 128: the forward's 128 x 32 and dK/dV's 16 x 32 spill inside their loops under key padding and packed rows.
        128: LaunchConfig(fwd=K(128, 16, num_warps=8, num_stages=1), dkdv=K(32, 16, num_warps=4),
                          dq=K(32, 32, num_warps=4, sums_by_matmul=False)),
        # 256: dK/dV's 8 warps halve each thread's share of its fixed block's float32 dK and dV (16 x 256 each), which
        # 4 warps hold only by spilling inside the exact pass's loop.
        256: LaunchConfig(fwd=K(16, 32, num_warps=4), dkdv=K(32, 16, num_warps=8, num_stages=1),
                          dq=K(16, 32, num_warps=4)),
    },
    (9, "half"): {
        16: LaunchConfig(fwd=K(128, 64, num_warps=8), dkdv=K(32, 128, num_warps=8), dq=K(128, 32, num_warps=8)),
        32: LaunchConfig(fwd=K(128, 64, num_warps=8), dkdv=K(32, 128, num_warps=8), dq=K(128, 32, num_warps=8)),
        64: LaunchConfig(fwd=K(64, 64, num_warps=4, max_registers=168), dkdv=K(32, 64, num_warps=4, max_registers=168),
                         dq=K(64, 32, num_warps=4, max_registers=168)),
        128: LaunchConfig(fwd=K(64, 32, num_warps=4, max_registers=168), dkdv=K(32, 64, num_warps=4),
                          dq=K(64, 32, num_warps=4)),
        # 256: 8.x's tiles; wgmma's blocks of 64 rows spill kilobytes inside their loops.
        256: LaunchConfig(fwd=K(16, 32, num_warps=4), dkdv=K(32, 16, num_warps=8, num_stages=1),
                          dq=K(16, 32, num_warps=4)),
    },
    # On sm_100, where matmuls of 64 rows and more take tcgen05, the 8.x tiles spill inside their loops (the forward at
    # 16 and 128, dK/dV at 16, dQ at 16 and 32); these do not.
    (10, "half"): {
        16: LaunchConfig(fwd=K(128, 32, num_warps=8), dkdv=K(32, 64, num_warps=4), dq=K(64, 32, num_warps=4)),
        32: LaunchConfig(fwd=K(128, 32, num_warps=8), dkdv=K(32, 64, num_warps=4), dq=K(64, 32, num_warps=4)),
        64: LaunchConfig(fwd=K(128, 32, num_warps=8), dkdv=K(16, 128, num_warps=8, num_stages=1),
                         dq=K(64, 16, num_warps=4)),
        128: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(32, 16, num_warps=4),
                          dq=K(32, 32, num_warps=4, sums_by_matmul=False)),
        256: LaunchConfig(fwd=K(16, 32, num_warps=4), dkdv=K(32, 16, num_warps=8, num_stages=1),
                          dq=K(16, 32, num_warps=4)),
    },
    # float32 above 64: each kernel's fixed block stays in memory, and the products over the head sizes load both
    # sides 32 columns at a time (``head_chunk``); held whole, dK/dV and dQ spill inside their loops at 128 with every
    # tile down to 16 x 16 and 8 warps.
    (8, "float32"): {
        16: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(128, 16, num_warps=8)),
        32: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(32, 16, num_warps=4)),
        64: LaunchConfig(fwd=K(32, 32, num_warps=4), dkdv=K(16, 16, num_warps=4), dq=K(32, 16, num_warps=4)),
        **FLOAT32_CHUNKED,
    },
    (9, "float32"): {
        16: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(128, 16, num_warps=8)),
        32: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(64, 16, num_warps=4)),
        64: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(32, 16, num_warps=4), dq=K(32, 16, num_warps=4)),
        **FLOAT32_CHUNKED,
    },
    # On sm_100 the 9.x tiles of dK/dV and dQ at 16 and of the forward at 32 spill inside their loops.
    (10, "float32"): {
        16: LaunchConfig(fwd=K(64, 32, num_warps=4), dkdv=K(16, 64, num_warps=4), dq=K(64, 16, num_warps=4)),
        32: LaunchConfig(fwd=K(16, 32, num_warps=4), dkdv=K(16, 64, num_warps=8), dq=K(32, 16, num_warps=4)),
        64: LaunchConfig(fwd=K(16, 32, num_warps=4), dkdv=K(16, 16, num_warps=4), dq=K(16, 32, num_warps=4)),
        **FLOAT32_CHUNKED,
    },
}
del K, _CHUNKED
# Tile sizes under the interpreter (CPU), where warps and stages mean nothing.
INTERPRETER_CONFIG = LaunchConfig(*(KernelConfig(64, 64, num_warps=4),) * 3)


@eager_cache
def interpreter_config(dtype, head_dim, value_dim):
    """INTERPRETER_CONFIG with the head chunks of these inputs' configuration on a GPU (``head_chunk``), so that the
    interpreter runs the kernels' paths that a GPU runs for them."""
    gpu = launch_config(dtype, head_dim, value_dim, MIN_CAPABILITY)
    if gpu is None:
        return INTERPRETER_CONFIG
    return LaunchConfig(*(config._replace(head_chunk=own.head_chunk) for config, own in zip(INTERPRETER_CONFIG, gpu)))


def padded_head_size(head_dim):
    """BLOCK_D of a head size: the next power of two, at least 16 (the smallest tl.dot operand)."""
    return max(16, 1 << (head_dim - 1).bit_length())


@eager_cache
def device_capability(device_index):
    """The compute capability (major, minor) of a CUDA device, fixed for the process: asked once (the query costs
    microseconds of host time at every call otherwise)."""
    return torch.cuda.get_device_capability(device_index)


def config_table(capability):
    """The generation of CONFIGS whose tiles a GPU of this compute capability (8.0 or later) runs: its family's for a
    checked capability, CONSERVATIVE_TABLE for any other."""
    capability = tuple(capability)
    return FAMILY_TABLES[capability[0]] if capability in SHARED_MEMORY_LIMIT else CONSERVATIVE_TABLE


def _configs(dtype, capability):
    return CONFIGS[config_table(capability), "float32" if dtype == torch.float32 else "half"]


# Runs while torch.compile traces too (once per compiled graph), where a logging call would break the graph.
@torch.compiler.assume_constant_result
def _log_unchecked(major, minor):
    checked = ", ".join(f"{a}.{b}" for a, b in SHARED_MEMORY_LIMIT)
    logger.warning_once(
        f"p-LaT attention: compute capability {major}.{minor} is not one the fused Triton kernels are checked for "
        f"({checked}): it runs the tiles of compute capability {CONSERVATIVE_TABLE}.x (sized for 99 KB of shared "
        "memory, the least among them), which were not compiled or tested for this GPU. plap_backend='tiled' runs the "
        "same maths without Triton."
    )
    return True


@eager_cache
def launch_config(dtype, head_dim, value_dim, capability):
    """The LaunchConfig of these inputs on a GPU of this compute capability, or None where none fits. A capability from
    8.0 on that the tables do not know gets CONSERVATIVE_TABLE's (and a warning, once per capability)."""
    capability = tuple(capability)
    if capability < MIN_CAPABILITY or dtype not in SUPPORTED_DTYPES:
        return None
    config = _configs(dtype, capability).get(max(padded_head_size(head_dim), padded_head_size(value_dim)))
    if config is not None and capability not in SHARED_MEMORY_LIMIT:
        _log_unchecked(*capability)
    return config


def capability_reason(capability, dtype, head_dim, value_dim):
    """None when a GPU of this compute capability has a configuration for these sizes, else why not."""
    if tuple(capability) < MIN_CAPABILITY:
        return (f"compute capability {capability[0]}.{capability[1]} is below 8.0: the kernels' matmuls take bfloat16 "
                "tensor-core instructions, and their tiles are checked from sm_80 on")  # fmt: skip
    if dtype in SUPPORTED_DTYPES and launch_config(dtype, head_dim, value_dim, capability) is None:
        largest = max(_configs(dtype, capability))
        return f"head sizes {head_dim} and {value_dim} in {dtype}: the kernels' tiles fit {largest} at most"
    return None
