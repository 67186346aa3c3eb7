"""Test-session setup shared by every suite.

pytest puts this folder on sys.path, so suites share tests/device.py, tests/tiny.py and tests/reference.py; the
scripts of experiments/ and benchmarks/ (folders of scripts, not packages) are importable through setup.cfg's
pytest ``pythonpath``. When the tests run on the CPU (tests/device.py: no GPU, or PLAT_TEST_DEVICE=cpu on a GPU
machine) the Triton kernels can only run under the Triton interpreter, which triton.jit reads when the kernels are
decorated: TRITON_INTERPRET=1 is set here, before any test module can import modeling_plat's Triton module. On a
GPU it stays unset, or the kernels would be interpreted there too instead of compiled.
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
