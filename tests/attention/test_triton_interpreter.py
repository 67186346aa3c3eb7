"""The suites' faster Triton interpreter (tests/triton_backend.py ``patch_language_once``): a grid whose kernel calls
helpers, its own and Triton's standard library's, computes what it should, and leaves triton.language as it was."""

import pytest
import torch

from modeling_plat import plap_attention_triton as triton_module

pytestmark = pytest.mark.skipif(not triton_module.INTERPRETED, reason="runs where the kernels are interpreted")

if triton_module.INTERPRETED:
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def _plus_blocks(x, n, BLOCK: tl.constexpr):
        return x + tl.cdiv(n, BLOCK)  # tl.cdiv: a helper of Triton's own, which reaches the language as ``core``

    @triton.jit
    def _helpers_kernel(Out, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Out + offsets, _plus_blocks(offsets, n, BLOCK), mask=offsets < n)


def test_a_grid_with_helpers_computes_and_restores_the_language():
    if not getattr(interpreter._patch_lang, "once", False):
        pytest.skip("this Triton's interpreter lacks what patch_language_once changes")
    builtins = (tl.add, tl.core.add, tl.cdiv, tl.tensor.__add__)
    for n in (5, 37):  # twice: the second grid finds the language as the first found it
        out = torch.full((n,), -1, dtype=torch.int32)
        _helpers_kernel[(triton.cdiv(n, 16),)](out, n, BLOCK=16)
        assert torch.equal(out, torch.arange(n, dtype=torch.int32) + triton.cdiv(n, 16))
        assert (tl.add, tl.core.add, tl.cdiv, tl.tensor.__add__) == builtins
