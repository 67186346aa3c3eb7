"""The one device every test builds its tensors, masks and references on, chosen once for the whole session.

CUDA when a GPU is present, else the CPU; ``PLAT_TEST_DEVICE=cpu`` forces the CPU on a GPU machine. Tests create
every tensor with ``device=DEVICE`` (or on their inputs' device), so that the same suite checks a GPU where there
is one; tests that only make sense on a GPU carry ``needs_cuda`` and are skipped elsewhere.
"""

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("PLAT_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
ON_CUDA = DEVICE.type == "cuda"
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU (tests run on the CPU here)")
# Half precision the device computes with: bfloat16 on CUDA; the Triton interpreter cannot multiply bfloat16
# (tl.dot treats its bits as integers, triton-lang/triton#11584), so float16 on the CPU.
TRITON_HALF = torch.bfloat16 if ON_CUDA else torch.float16
