"""Test-session setup shared by every suite.

pytest puts this folder on sys.path, so suites share tests/device.py, tests/tiny.py and tests/reference.py; the
scripts of experiments/, benchmarks/ and tools/kernels/ (folders of scripts, not packages) are importable through
setup.cfg's pytest ``pythonpath``. tests/triton_backend.py sets the Triton interpreter on the CPU before any test
module can import modeling_plat's Triton module.
"""

from triton_backend import two_passes  # noqa: F401
