"""Test-session setup shared by every suite.

pytest puts this folder on sys.path, so suites share tests/tiny.py and tests/reference.py; the experiments'
scripts (a folder of scripts, not a package) are put there too. Without CUDA the
Triton kernels can only run under the Triton interpreter, which triton.jit reads when the kernels are
decorated: TRITON_INTERPRET=1 is set here, before any test module can import modeling_plat's Triton module.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
