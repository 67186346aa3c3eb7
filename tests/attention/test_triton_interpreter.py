"""The suites' faster Triton interpreter (tests/triton_backend.py): a grid whose kernel calls helpers, its own and
Triton's standard library's, computes what it should, and leaves triton.language as it was; integer arithmetic
computes the same without the overflow checks that nothing reads, and a debug run keeps them."""

import dataclasses

import pytest
import torch

from modeling_plat import plap_attention_triton as triton_module
from triton_backend import drop_discarded_overflow_checks

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

    @triton.jit
    def _int32_kernel(Out, x, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(Out + offsets, (offsets + x) * x - offsets)  # wraps around for the larger x


def test_a_grid_with_helpers_computes_and_restores_the_language():
    if not getattr(interpreter._patch_lang, "once", False):
        pytest.skip("this Triton's interpreter lacks what patch_language_once changes")
    builtins = (tl.add, tl.core.add, tl.cdiv, tl.tensor.__add__)
    for n in (5, 37):  # twice: the second grid finds the language as the first found it
        out = torch.full((n,), -1, dtype=torch.int32)
        _helpers_kernel[(triton.cdiv(n, 16),)](out, n, BLOCK=16)
        assert torch.equal(out, torch.arange(n, dtype=torch.int32) + triton.cdiv(n, 16))
        assert (tl.add, tl.core.add, tl.cdiv, tl.tensor.__add__) == builtins


def test_overflow_checks_are_dropped_only_where_nothing_reads_them(monkeypatch):
    builder = interpreter.interpreter_builder
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow"):
        pytest.skip("this Triton's interpreter has no overflow checks to drop")
    assert options.debug is False and options.sanitize_overflow is False

    def run(x):
        out = torch.zeros(16, dtype=torch.int32)
        _int32_kernel[(1,)](out, x, BLOCK=16)
        return out

    checked = dataclasses.replace(options, sanitize_overflow=True)
    for x in (7, 2**20 + 3):  # exact, then past int32
        offsets = torch.arange(16, dtype=torch.int64)
        wrapped = ((offsets + x) * x - offsets + 2**31) % 2**32 - 2**31
        monkeypatch.setattr(builder, "options", checked)
        assert torch.equal(run(x), wrapped.int())
        monkeypatch.setattr(builder, "options", options)
        assert torch.equal(run(x), wrapped.int())
    monkeypatch.setattr(builder, "options", dataclasses.replace(checked, debug=True))
    drop_discarded_overflow_checks()
    assert builder.options.sanitize_overflow is True
    with pytest.raises(Exception, match="overflow"):
        run(2**20 + 3)
