"""Test-session setup shared by every suite.

pytest puts this folder on sys.path, so suites share tests/tiny.py and tests/reference.py; the scripts of
experiments/ and benchmarks/ (folders of scripts, not packages) are importable through setup.cfg's pytest
``pythonpath``. Without CUDA the Triton kernels can only run under the Triton interpreter, which triton.jit
reads when the kernels are decorated: TRITON_INTERPRET=1 is set here, before any test module can import
modeling_plat's Triton module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
