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

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest opt-in shared memory per block (bytes) of the compute capabilities the kernels are compiled and checked for
# (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY_LIMIT = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448}


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
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2
    max_registers: int = 0
    sums_by_matmul: bool = True


class LaunchConfig(NamedTuple):
    """One KernelConfig per kernel."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig

    def with_blocks(self, block_m, block_n):
        return LaunchConfig(*(config._replace(block_m=block_m, block_n=block_n) for config in self))


K = KernelConfig
# By GPU generation (8: Ampere and Ada, sized for sm_86/sm_89's 99 KB of shared memory; 9: Hopper), input kind and
# padded head size (``padded_head_size``). A head size above a generation's largest entry has no configuration.
CONFIGS = {
    (8, "half"): {
        16: LaunchConfig(fwd=K(128, 64, num_warps=8), dkdv=K(32, 128, num_warps=8), dq=K(128, 32, num_warps=8)),
        32: LaunchConfig(fwd=K(128, 32, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(128, 32, num_warps=8)),
        64: LaunchConfig(fwd=K(128, 32, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(128, 16, num_warps=8)),
        128: LaunchConfig(fwd=K(128, 32, num_warps=8), dkdv=K(16, 32, num_warps=4, sums_by_matmul=False),
                          dq=K(32, 32, num_warps=4, sums_by_matmul=False)),
    },
    (9, "half"): {
        16: LaunchConfig(fwd=K(128, 64, num_warps=8), dkdv=K(32, 128, num_warps=8), dq=K(128, 32, num_warps=8)),
        32: LaunchConfig(fwd=K(128, 64, num_warps=8), dkdv=K(32, 128, num_warps=8), dq=K(128, 32, num_warps=8)),
        64: LaunchConfig(fwd=K(64, 64, num_warps=4, max_registers=168), dkdv=K(32, 64, num_warps=4, max_registers=168),
                         dq=K(64, 32, num_warps=4, max_registers=168)),
        128: LaunchConfig(fwd=K(64, 32, num_warps=4, max_registers=168), dkdv=K(32, 64, num_warps=4),
                          dq=K(64, 32, num_warps=4)),
    },
    (8, "float32"): {
        16: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(128, 16, num_warps=8)),
        32: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(32, 16, num_warps=4)),
        64: LaunchConfig(fwd=K(32, 32, num_warps=4), dkdv=K(16, 16, num_warps=4), dq=K(32, 16, num_warps=4)),
    },
    (9, "float32"): {
        16: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(128, 16, num_warps=8)),
        32: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(16, 128, num_warps=8), dq=K(64, 16, num_warps=4)),
        64: LaunchConfig(fwd=K(128, 16, num_warps=8), dkdv=K(32, 16, num_warps=4), dq=K(32, 16, num_warps=4)),
    },
}
del K
# Tile sizes under the interpreter (CPU), where warps and stages mean nothing.
INTERPRETER_CONFIG = LaunchConfig(*(KernelConfig(64, 64, num_warps=4),) * 3)


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


def capability_reason(capability, dtype, head_dim, value_dim):
    """None when a GPU of this compute capability has a checked configuration for these sizes, else why not."""
    if capability not in SHARED_MEMORY_LIMIT:
        known = ", ".join(f"{major}.{minor}" for major, minor in SHARED_MEMORY_LIMIT)
        return f"compute capability {capability[0]}.{capability[1]} is not one the kernels are checked for ({known})"
    if dtype in SUPPORTED_DTYPES and launch_config(dtype, head_dim, value_dim, capability) is None:
        largest = max(_configs(dtype, capability))
        return f"head sizes {head_dim} and {value_dim} in {dtype}: the kernels' tiles fit {largest} at most"
    return None
