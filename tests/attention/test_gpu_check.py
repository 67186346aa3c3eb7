"""benchmarks/gpu_check.py's bookkeeping, on CPU: the sweep's cases, how results are judged, the report, and
its measurement of one case run for real with the CPU backends (and the Triton interpreter)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from modeling_plat import plap_attention_triton as triton_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_sweep_covers_every_combination():
    cases = gpu_check.sweep_cases()
    backend_cases = [c for c in cases if c["kind"] == "backend"]
    assert len(backend_cases) == 3 * 5 * 2 * 2 * 2 * 2  # dtypes, head sizes, formulations, masks, lengths, backends
    combinations = {(c["dtype"], c["head_dim"], c["formulation"], c["masked"], c["shape"], c["backend"])
                    for c in backend_cases}  # fmt: skip
    assert len(combinations) == len(backend_cases)
    assert {c["head_dim"] for c in backend_cases} == {16, 48, 64, 80, 128}
    assert {c["shape"][2] < c["shape"][3] for c in backend_cases} == {False, True}  # Nq = Nk and Nq < Nk
    tf32_cases = [c for c in cases if c["kind"] == "tf32"]
    assert {(c["backend"], c["formulation"]) for c in tf32_cases} == {
        ("eager", "paper"), ("eager", "euler"), ("tiled", "paper"), ("tiled", "euler")
    }
    assert len({gpu_check.case_name(c) for c in cases}) == len(cases)


def ok_result(**errors):
    full = dict(dict(out=1e-6, dq=1e-6, dk=1e-6, dv=1e-6), **errors)
    return dict(status="ok", backend="triton", errors=full, finite=True, bitwise_rerun=True)


def test_judging_of_results():
    case = gpu_check.sweep_cases()[0]
    bf16 = dict(case, dtype="bfloat16")
    assert gpu_check.judge(bf16, ok_result(dv=1e-2)) == []
    assert gpu_check.judge(bf16, ok_result(dv=3e-2)) == ["dv error 3.00e-02 > 2.0e-02"]
    assert gpu_check.judge(bf16, ok_result(dq=float("nan"))) == ["dq error nan > 2.0e-02"]
    assert gpu_check.judge(bf16, dict(ok_result(), finite=False, bitwise_rerun=False)) == [
        "non-finite values", "a second run differs"
    ]
    assert gpu_check.judge(bf16, dict(status="skipped", reason="head sizes ...")) == []
    tf32 = dict(case, kind="tf32", dtype="float32")
    # Under TF32 twice the float32 floor is allowed, not more.
    floor = dict(out=1e-6, dq=1e-6, dk=1e-6, dv=5e-2)
    assert gpu_check.judge(tf32, dict(ok_result(dv=9e-2), errors_without_tf32=floor)) == []
    assert gpu_check.judge(tf32, dict(ok_result(dv=2e-1), errors_without_tf32=floor)) == ["dv error 2.00e-01 > 1.0e-01"]


def test_sweep_records_failures_and_crashes():
    cases = gpu_check.sweep_cases()[:3]

    def runner(case):
        if case is cases[1]:
            raise RuntimeError("the Triton backend failed in _plap_fwd_kernel")
        return ok_result(dk=0.5) if case is cases[2] else ok_result()

    results = gpu_check.run_sweep(cases, runner, log=lambda line: None)
    assert [r["failures"] for r in results] == [
        [], ["RuntimeError: the Triton backend failed in _plap_fwd_kernel"], ["dk error 5.00e-01 > 1.0e-04"]
    ]
    assert results[1]["status"] == "error" and "Traceback" in results[1]["trace"]
    assert [r["case"] for r in results] == [gpu_check.case_name(c) for c in cases]


def small_case(**overrides):
    case = dict(kind="backend", backend="auto", dtype="float32", head_dim=16, formulation="euler", masked=True,
                shape=(2, 3, 9, 20))  # fmt: skip
    return dict(case, **overrides)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_case_measured_for_real_on_cpu(backend):
    if backend == "triton" and not triton_module.INTERPRETED:
        pytest.skip("the Triton backend runs on CPU only under the interpreter")
    result = gpu_check.run_case(small_case(backend=backend), torch.device("cpu"))
    assert result["status"] == "ok" and result["backend"] in ("eager", "tiled", "triton")
    assert result["finite"] and result["bitwise_rerun"]
    assert set(result["errors"]) == {"out", "dq", "dk", "dv"}
    assert max(result["errors"].values()) < 1e-5
    assert gpu_check.judge(small_case(), result) == []


def test_tf32_case_and_skips_on_cpu(monkeypatch):
    tf32 = gpu_check.run_case(small_case(kind="tf32", backend="tiled", formulation="paper"), torch.device("cpu"))
    assert set(tf32["errors_without_tf32"]) == {"out", "dq", "dk", "dv"}
    monkeypatch.setattr(triton_module, "INTERPRETED", False)  # the Triton backend then refuses CPU tensors
    skipped = gpu_check.run_case(small_case(backend="triton"), torch.device("cpu"))
    assert skipped["status"] == "skipped" and "backend 'triton' cannot run this input" in skipped["reason"]


def test_report_is_json(tmp_path):
    report = dict(environment=dict(gpu="fake"), sweep=[dict(case="x", failures=[])], failures=[])
    path = gpu_check.write_report(tmp_path / "out", report)
    assert json.loads(path.read_text()) == report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_gpu_exits_with_a_message(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
