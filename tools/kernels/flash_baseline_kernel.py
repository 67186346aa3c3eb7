"""A minimal FlashAttention-2-style softmax attention forward in Triton: the yardstick of gpu_static_cost.py.

It is compiled, never launched: its main loop is what a softmax attention kernel needs per score (one QK^T
and one PV matmul, the online softmax with one exp2) and nothing more, so that the p-Laplacian kernels'
instructions per score are compared with a floor written in the same language, compiled by the same compiler.
Inputs are contiguous (B, H, N, d) with N a multiple of the blocks (no bounds masks); causal is optional.
"""

import math

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, Out, Lse, num_tokens, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    slab = pid_bh.to(tl.int64) * num_tokens * HEAD_DIM
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + slab + rows[:, None] * HEAD_DIM + dims[None, :])
    row_max = tl.full([BLOCK_M], -1.0e38, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = (pid_m + 1) * BLOCK_M if IS_CAUSAL else num_tokens
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + slab + cols[:, None] * HEAD_DIM + dims[None, :])
        v = tl.load(V + slab + cols[:, None] * HEAD_DIM + dims[None, :])
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        if IS_CAUSAL:
            scores = tl.where(cols[None, :] <= rows[:, None], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        rescale = tl.exp2(row_max - new_max)
        expo = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(expo, 1)
        acc = acc * rescale[:, None] + tl.dot(expo.to(v.dtype), v)
        row_max = new_max
    tl.store(Out + slab + rows[:, None] * HEAD_DIM + dims[None, :], (acc / row_sum[:, None]).to(Out.dtype.element_ty))
    tl.store(Lse + pid_bh.to(tl.int64) * num_tokens + rows, row_max + tl.log2(row_sum))


def baseline_launch(query, out, lse, is_causal, config, launch_type):
    """The forward launch (a ``launch_type`` Launch) for contiguous (B, H, N, d) query-shaped inputs."""
    batch, heads, num_tokens, head_dim = query.shape
    grid = (triton.cdiv(num_tokens, config.block_m), batch * heads)
    args = (query, query, query, out, lse, num_tokens, LOG2_E / math.sqrt(head_dim))
    meta = dict(HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, IS_CAUSAL=is_causal,
                num_warps=config.num_warps, num_stages=config.num_stages)  # fmt: skip
    return launch_type(_flash_fwd_kernel, grid, args, meta)
