"""tools/kernels/compiled_graph.py: torch.compile's graphs of a fused call launch what an eager call launches, and
after Inductor's reinplacing no launch copies a tensor, with the launch configurations of real GPUs (traced on the CPU,
in a child process without the Triton interpreter)."""

import importlib.util
import json
import subprocess
import sys

import pytest

import compiled_graph
from triton_aot import case_id, child_environment

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_compiled_calls_launch_the_eager_kernels_and_copy_no_tensor(tmp_path):
    child = subprocess.run([sys.executable, compiled_graph.__file__], env=child_environment(tmp_path),
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    reports = [json.loads(line) for line in child.stdout.splitlines()]
    assert [report["case"] for report in reports] == [case_id(case) for case in compiled_graph.DEFAULT_CASES]
    for report in reports:
        forward, backward = report["forward"], report["backward"]
        assert [launch["kernel"] for launch in forward + backward] == report["eager"], report["case"]
        assert all(launch["kernel"].startswith("fwd") for launch in forward), report["case"]
        copied = [launch for launch in forward + backward if launch["clones"]]
        assert not copied, f"{report['case']}: launches that torch.compile copies tensors for: {copied}"
