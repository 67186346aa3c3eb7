"""TF32 matmul inputs emulated on CPU, for tests of what GPUs do to float32 matmuls.

TF32 keeps float32's sign and exponent and 10 of its 23 mantissa bits; tensor cores round float32 inputs to
it (round to nearest, ties away: cvt.rna.tf32.f32), multiply exactly and accumulate in float32.
"""

import torch


def round_tf32(x):
    """float32 tensor rounded to TF32 by bit arithmetic: add half of the dropped 13 bits, then mask them."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + (1 << 12)) & -(1 << 13)).view(torch.float32)


def tf32_matmul(a, b):
    """a @ b of float32 tensors as a TF32 tensor-core matmul: rounded inputs, exact products (float64 here)."""
    return (round_tf32(a).double() @ round_tf32(b).double()).float()
