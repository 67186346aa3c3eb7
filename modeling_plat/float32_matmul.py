"""Float32 matmuls that stay float32-exact where CUDA would round their inputs to TF32.

Used where a squared distance |x|^2 + |y|^2 - 2 x.y is formed or its gradient multiplied: the 2^-11 rounding of
TF32 inputs becomes an O(1) error of near-coinciding values after the cancellation, exactly where the
p-Laplacian weight is largest. Everywhere else (CPU, half precision, TF32 off) these are torch's own matmuls.
"""

import torch

# As int32: keeps the sign, the exponent and the 10 mantissa bits of TF32 of a float32 (0xFFFFE000).
TF32_MASK = -(1 << 13)


def _tf32_split(x):
    """(high, low): x's float32 values cut to the 10 mantissa bits of TF32 (exact in TF32), and x - high (exact)."""
    high = (x.view(torch.int32) & TF32_MASK).view(torch.float32)
    return high, x - high


def _split_bmm(a, b, bmm=torch.bmm):
    """a @ b of float32 batches to about float32 accuracy from three matmuls that round their inputs to TF32:
    high.high + high.low + low.high, the low.low term being below float32 resolution (tf32x3)."""
    a_high, a_low = _tf32_split(a)
    b_high, b_low = _tf32_split(b)
    return bmm(a_high, b_high) + (bmm(a_high, b_low) + bmm(a_low, b_high))


# Dynamo cannot trace the precision getter (a graph break per call, and none with fullgraph=True): a compiled
# graph reads the setting once, while it is traced, and keeps what it read.
@torch.compiler.assume_constant_result
def _cuda_matmul_allows_tf32():
    """Whether CUDA float32 matmuls may round their inputs to TF32 (allow_tf32, float32 matmul precision
    "high" or "medium")."""
    try:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"  # PyTorch >= 2.9, set by either API
    except AttributeError:
        return torch.backends.cuda.matmul.allow_tf32


def _tf32_may_round(tensor):
    return tensor.dtype == torch.float32 and tensor.device.type == "cuda" and _cuda_matmul_allows_tf32()


def float32_baddbmm_(input, batch1, batch2, alpha=1):
    """In place, ``input.baddbmm_(batch1, batch2, alpha=alpha)`` to float32 accuracy, also under TF32; outside
    autograd (the tiled backend's accumulations).

    For the matmuls that form a squared distance |x|^2 + |y|^2 - 2 x.y or multiply its gradient: where CUDA runs
    float32 matmuls in TF32, the 2^-11 rounding of their inputs becomes an O(1) error of near-coinciding values
    after the cancellation, exactly where the p-Laplacian weight is largest. There, each float32 operand is split
    into a TF32 part and the rest and three matmuls make up the product; elsewhere this is ``baddbmm_``.
    """
    if _tf32_may_round(batch1):
        return input.add_(_split_bmm(batch1, batch2), alpha=alpha)
    return input.baddbmm_(batch1, batch2, alpha=alpha)
