"""How the suites run the Triton backend, imported by every conftest.py before any test module can import
modeling_plat's Triton module.

When the tests run on the CPU (tests/device.py: no GPU, or PLAT_TEST_DEVICE=cpu on a GPU machine) the Triton kernels
can only run under the Triton interpreter, which triton.jit reads when the kernels are decorated: TRITON_INTERPRET=1
is set on import. On a GPU it stays unset, or the kernels would be interpreted there too instead of compiled.
"""

import os

import pytest

from device import ON_CUDA

if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def two_passes(monkeypatch):
    """Every Triton call runs each kernel's first pass, then its exact pass on the flagged blocks, as calls above
    ``ONE_PASS_PAIRS`` do: the tests' small calls would run the exact pass alone."""
    from modeling_plat import plap_attention_triton

    monkeypatch.setattr(plap_attention_triton, "ONE_PASS_PAIRS", 0)
