"""Test-session setup shared by every suite.

pytest puts this folder on sys.path, so suites share tests/device.py, tests/tiny.py and tests/reference.py; the
scripts of experiments/, benchmarks/ and tools/kernels/ (folders of scripts, not packages) are importable through
setup.cfg's pytest ``pythonpath``. tests/triton_backend.py sets the Triton interpreter on the CPU before any test
module can import modeling_plat's Triton module.
"""

import pytest
from triton_backend import two_passes  # noqa: F401

from modeling_plat import plap_dispatch


@pytest.fixture(autouse=True)
def fresh_backend_choices():
    """Each test starts with no kept choice of backend (``plap_dispatch.choose_backend``): several replace what a
    choice reads (the Triton version, the interpreter's flag) for the length of the test."""
    plap_dispatch._CHOICES.clear()
