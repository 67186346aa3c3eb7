"""How the suites run the Triton backend, imported by every conftest.py before any test module can import
modeling_plat's Triton module.

When the tests run on the CPU (tests/device.py: no GPU, or PLAT_TEST_DEVICE=cpu on a GPU machine) the Triton kernels
can only run under the Triton interpreter, which triton.jit reads when the kernels are decorated: TRITON_INTERPRET=1
is set on import. On a GPU it stays unset, or the kernels would be interpreted there too instead of compiled.

Two changes make the interpreter faster without changing what it computes (each only where this Triton's interpreter
has what it changes; else the tests run as before):

The interpreter re-patches triton.language at every call of a ``@triton.jit`` helper inside a kernel (Triton 3.9:
``interpreter._patch_lang`` walks every member of ``tl``, ``tl.core``, ``tl.tensor`` and ``tl.math``), about 1.4 ms a
call on a 2-core VM: a third of an interpreted forward + backward of the kernels, whose tiles call helpers in their
loops. ``patch_language_once`` makes each grid's run patch the language once for every helper it calls.

And every int32 add, sub and mul of offsets builds an overflow check (``binary_op_sanitize_overflow_impl``: both sides
cast to int64, the operation, two bounds, two comparisons) that ``device_assert`` then drops, since the interpreter's
options never ask for debug: 40% of an interpreted forward + backward at head size 160.
``drop_discarded_overflow_checks`` stops building them.
"""

import dataclasses
import os
import sys

import pytest

from device import ON_CUDA


def patch_language_once():
    """Patch triton.language once per interpreted grid instead of once per helper call, where this Triton's
    interpreter has the functions it changes (else nothing changes: the tests run as slowly as before).

    A grid's run (``GridExecutor.__call__``) patches the language for its kernel, which reaches it as ``tl``, and
    restores it at its end; a helper called inside patches it again for the names its own module reaches it by
    (``tl``, or ``core`` in Triton's standard library), without restoring. Here the grid's patch covers both names,
    and a helper called while a grid runs patches nothing more: what it would patch is patched already. A helper
    called outside any grid patches as before."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or executor is None or getattr(patch, "once", False):
        return
    grid_code = executor.__call__.__code__

    class BothNames:  # what _patch_lang reads of a kernel: the modules its globals hold
        __globals__ = {"tl": tl, "core": tl.core}

    class GridScope:
        open = 0

        def __init__(self, scope):
            self.scope = scope
            GridScope.open += 1

        def restore(self):
            GridScope.open -= 1
            self.scope.restore()

    class Nothing:
        def restore(self):
            pass

    def patch_once(fn):
        if sys._getframe(1).f_code is grid_code:
            return GridScope(patch(BothNames))
        return Nothing() if GridScope.open else patch(fn)

    patch_once.once = True
    interpreter._patch_lang = patch_once


def drop_discarded_overflow_checks():
    """Turn the interpreter's ``sanitize_overflow`` off where its ``debug`` is off: Triton builds the checks it asks for
    only to hand them to ``device_assert``, which without debug returns before looking at them."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False) is True \
            and getattr(options, "debug", True) is False:  # fmt: skip
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    patch_language_once()
    drop_discarded_overflow_checks()


@pytest.fixture
def two_passes(monkeypatch):
    """Every Triton call runs each kernel's first pass, then its exact pass on the flagged blocks, as calls above
    ``ONE_PASS_PAIRS`` do: the tests' small calls would run the exact pass alone."""
    from modeling_plat import plap_attention_triton

    monkeypatch.setattr(plap_attention_triton, "ONE_PASS_PAIRS", 0)
