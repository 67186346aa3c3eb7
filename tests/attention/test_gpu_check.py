"""benchmarks/gpu_check.py on CPU: the sweep's cases and how results are judged, each section run for real at tiny
sizes (the CPU backends and the Triton interpreter; aot_eager for torch.compile), the budget guard, the recording of
failures, the targets' verdicts and the record."""

import json
import multiprocessing
import sys
import time
from pathlib import Path

import pytest
import torch

import gpu_check
from gpu_sections.attention import (attention_section, attention_timings, envelope_section, fallback_section,
                                    timed_fields)  # fmt: skip
from gpu_sections.kernels import (CONFIG_VARIANTS, HOST_PROFILE_TOP, KERNEL_CASES, KernelCase, against_adopted,
                                  changed_launch_configs, host_profile, host_times, kernel_times, kernels_section,
                                  launch_costs, split_256, token_values, uncapped, wide_256)  # fmt: skip
from gpu_sections.measure import backend_spy, no_log, paired_ratio, relative_error, side_by_side
from gpu_sections.models import (COMPILE_PRESETS, compile_section, decode_section, main_job_arguments, main_job_section,
                                 other_kernels, train_section)  # fmt: skip
from gpu_sections.sweep import (FEW_HEAD_DIMS, HEAD_DIMS, REPEATS, SQUARE, attend, case_name, each_document_alone,
                                interleaved, judge, make_case_inputs, run_case, run_sweep, sweep_cases,
                                sweep_section)  # fmt: skip
from gpu_sections.targets import collect_failures, judge_targets, peak_memory_target
from device import DEVICE
from test_backends import check, make_inputs, make_mask, run_triton
from modeling_plat import plap_attention
from modeling_plat import plap_attention_triton as triton_module
from plat_train.presets import resolve_config_name

CPU = torch.device("cpu")


def test_sweep_covers_every_combination():
    cases = sweep_cases()
    backend_cases = [c for c in cases if c["kind"] == "backend" and c["head_dim"] in HEAD_DIMS]
    # dtypes, head sizes, formulations, masks, lengths, backends (and Triton's two passes as a third)
    assert len(backend_cases) == 3 * 5 * 2 * 2 * 2 * 3
    combinations = {(c["dtype"], c["head_dim"], c["formulation"], c["masked"], c["shape"], c["backend"],
                     c.get("two_passes", False)) for c in backend_cases}  # fmt: skip
    assert {c["backend"] for c in backend_cases if c.get("two_passes")} == {"triton"}
    assert len(combinations) == len(backend_cases)
    assert {c["head_dim"] for c in backend_cases} == {16, 48, 64, 80, 128}
    assert {c["shape"][2] < c["shape"][3] for c in backend_cases} == {False, True}  # Nq = Nk and Nq < Nk
    tf32_cases = [c for c in cases if c["kind"] == "tf32"]
    assert {(c["backend"], c["formulation"]) for c in tf32_cases} == {
        ("eager", "paper"), ("eager", "euler"), ("tiled", "paper"), ("tiled", "euler")
    }
    for kind in ("repeated", "packed"):
        kind_cases = {(c["backend"], c["dtype"], c["head_dim"], c["formulation"], c["masked"], c.get("two_passes"))
                      for c in cases if c["kind"] == kind and c["head_dim"] in FEW_HEAD_DIMS}  # fmt: skip
        assert len(kind_cases) == 3 * 3 * 3 * 2 * 2  # auto, triton and triton's two passes
    assert {(c["model"], c["dtype"]) for c in cases if c["kind"] == "convert"} == {
        (model, dtype) for model in ("gpt2", "llama", "vit") for dtype in ("float32", "bfloat16")
    }
    # The envelope: a causal window with key padding at three head sizes, and head sizes 160 and 256 (repeated values
    # at 256), each dtype and formulation, auto and triton (and its two passes).
    groups = [("window", head_dim) for head_dim in FEW_HEAD_DIMS] + [("backend", 160), ("backend", 256),
                                                                     ("repeated", 256)]  # fmt: skip
    envelope = {group: {(c["backend"], c.get("two_passes", False), c["dtype"], c["formulation"])
                        for c in cases if (c["kind"], c.get("head_dim")) == group} for group in groups}  # fmt: skip
    assert all(len(combinations) == 3 * 3 * 2 for combinations in envelope.values()), envelope
    assert all(c["window"] < c["shape"][3] and c["masked"] for c in cases if c["kind"] == "window")
    assert len({case_name(c) for c in cases}) == len(cases)
    # A sweep cut short by its time has checked some of every group: the first round holds one of each.
    assert {c["kind"] for c in cases[:6]} == {"backend", "window", "repeated", "tf32", "convert"}
    # Side by side, the first workers of a group build different kernels.
    first = [c for c in cases if c["kind"] == "backend" and not c.get("two_passes")][:15]
    assert len({(c["dtype"], c["head_dim"]) for c in first}) == 15


def test_interleaved_takes_a_case_of_each_group_in_turn():
    assert interleaved([[1, 2, 3], ["a"], [], [7, 8]]) == [1, "a", 7, 2, 8, 3]


def ok_result(**errors):
    full = dict(dict(out=1e-6, dq=1e-6, dk=1e-6, dv=1e-6), **errors)
    return dict(status="ok", backend="triton", errors=full, finite=True, bitwise_rerun=True)


def test_judging_of_results():
    case = sweep_cases()[0]
    bf16 = dict(case, dtype="bfloat16")
    assert judge(bf16, ok_result(dv=1e-2)) == []
    assert judge(bf16, ok_result(dv=3e-2)) == ["dv error 3.00e-02 > 2.0e-02"]
    assert judge(bf16, ok_result(dq=float("nan"))) == ["dq error nan > 2.0e-02"]
    assert judge(bf16, dict(ok_result(), finite=False, bitwise_rerun=False)) == [
        "non-finite values", "a second run differs"
    ]
    assert judge(bf16, dict(status="skipped", reason="head sizes ...")) == []
    tf32 = dict(case, kind="tf32", dtype="float32")
    # Under TF32: TF32's own error, or twice the error without TF32 where that is larger; not more.
    floor = dict(out=1e-7, dq=1e-7, dk=1e-7, dv=5e-2)
    assert judge(tf32, dict(ok_result(out=7e-4, dv=9e-2), errors_without_tf32=floor)) == []
    assert judge(tf32, dict(ok_result(out=3e-3, dv=2e-1), errors_without_tf32=floor)) == [
        "out error 3.00e-03 > 2.0e-03", "dv error 2.00e-01 > 1.0e-01"
    ]


def test_sweep_records_failures_and_crashes():
    cases = [case for case in sweep_cases() if case["dtype"] == "float32"][:3]

    def runner(case):
        if case is cases[1]:
            raise RuntimeError("the Triton backend failed in _plap_fwd_kernel")
        return ok_result(dk=0.5) if case is cases[2] else ok_result()

    results = run_sweep(cases, runner, log=no_log)
    assert [r["failures"] for r in results] == [
        [], ["RuntimeError: the Triton backend failed in _plap_fwd_kernel"], ["dk error 5.00e-01 > 1.0e-04"]
    ]
    assert results[1]["status"] == "error" and "Traceback" in results[1]["trace"]
    assert [r["case"] for r in results] == [case_name(c) for c in cases]


def small_case(**overrides):
    case = dict(kind="backend", backend="auto", dtype="float32", head_dim=16, formulation="euler", masked=True,
                shape=(2, 3, 9, 20))  # fmt: skip
    return dict(case, **overrides)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_case_measured_for_real_on_cpu(backend):
    if backend == "triton" and not triton_module.INTERPRETED:
        pytest.skip("the Triton backend runs on CPU only under the interpreter")
    result = run_case(small_case(backend=backend), CPU)
    assert result["status"] == "ok" and result["backend"] in ("eager", "tiled", "triton")
    assert result["finite"] and result["bitwise_rerun"]
    assert set(result["errors"]) == {"out", "dq", "dk", "dv"}
    assert max(result["errors"].values()) < 1e-5
    assert judge(small_case(), result) == []


@pytest.mark.parametrize("kind, masked", [("repeated", True), ("packed", True), ("packed", False)])
def test_repeated_values_and_packed_rows_on_cpu(kind, masked):
    case = small_case(kind=kind, masked=masked, shape=SQUARE)
    inputs, p, kwargs, grad_out = make_case_inputs(case, CPU)
    if kind == "repeated":
        value = inputs[2]
        assert all(torch.equal(value[:, :, position], value[:, :, 4]) for position in REPEATS)
    else:
        assert kwargs["is_causal"] == masked and "attn_mask" not in kwargs
        assert kwargs["document_ids"].shape == (2, 200) and kwargs["document_ids"][0].unique().numel() == 4
    result = run_case(case, CPU)
    assert result["status"] == "ok" and judge(case, result) == [], result


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_window_case_on_cpu(backend):
    """The window reaches the call (a window of 5 keys over 20, with key padding); without it the output is far from
    the reference, so the check can fail."""
    if backend == "triton" and not triton_module.INTERPRETED:
        pytest.skip("the Triton backend runs on CPU only under the interpreter")
    case = small_case(kind="window", backend=backend, window=5)
    inputs, p, kwargs, grad_out = make_case_inputs(case, CPU)
    assert kwargs["sliding_window"] == 5 and kwargs["is_causal"] and kwargs["attn_mask"] is not None
    result = run_case(case, CPU)
    assert result["status"] == "ok" and judge(case, result) == [], result
    windowless = {name: value for name, value in kwargs.items() if name != "sliding_window"}
    assert relative_error(attend(inputs, p, windowless, "eager"), attend(inputs, p, kwargs, "eager")) > 0.1


def test_packed_reference_is_each_document_alone():
    """Attention across documents (document_ids ignored) is far from the reference: the check can fail."""
    case = small_case(kind="packed", shape=SQUARE)
    inputs, p, kwargs, _ = make_case_inputs(case, CPU)
    with torch.no_grad():
        alone = each_document_alone(inputs, p, kwargs, "eager")
        packed = attend(inputs, p, kwargs, "eager")
        across = attend(inputs, p, dict(kwargs, document_ids=None), "eager")
    assert relative_error(packed, alone) < 1e-6
    assert relative_error(across, alone) > 1e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_conversion_case_on_cpu(dtype):
    case = dict(kind="convert", model="llama", dtype=dtype)
    result = run_case(case, CPU)
    assert result["status"] == "ok" and judge(case, result) == []
    assert result["max_abs_diff"] <= 1e-2 * result["max_abs_logit"]


def test_tf32_case_and_skips_on_cpu(monkeypatch):
    tf32 = run_case(small_case(kind="tf32", backend="tiled", formulation="paper"), CPU)
    assert set(tf32["errors_without_tf32"]) == {"out", "dq", "dk", "dv"}
    monkeypatch.setattr(triton_module, "INTERPRETED", False)  # the Triton backend then refuses CPU tensors
    skipped = run_case(small_case(backend="triton"), CPU)
    assert skipped["status"] == "skipped" and "backend 'triton' cannot run this input" in skipped["reason"]


def test_sweep_in_a_spawned_worker():
    """Results come back in the cases' order; a case that raises in the worker is an error with its traceback."""
    cases = [small_case(), small_case(dtype="no-such-dtype")]
    results = sweep_section(CPU, no_log, workers=1, cases=cases)
    assert results[0]["status"] == "ok" and results[0]["failures"] == []
    assert results[1]["status"] == "error" and results[1]["failures"] == ["KeyError: 'no-such-dtype'"]
    assert "make_case_inputs" in results[1]["trace"]  # the worker's own traceback


def test_backend_spy_counts_the_dispatchers_choices_and_restores_it():
    module = sys.modules["modeling_plat.plap_dispatch"]
    original = module.choose_backend
    q = torch.randn(1, 2, 8, 4)
    with backend_spy() as chosen:
        plap_attention(q, q, q, (1.5, 2.0))  # the p = 2 head runs SDPA: no choice
        plap_attention(q, q, q, 2.5, backend="tiled")
    assert chosen == {"eager": 1, "tiled": 1}
    assert module.choose_backend is original


def test_attention_section_on_cpu():
    rows = attention_section(CPU, no_log, shapes={"tiny": (1, 2, 24, 8, True)}, warmup=0, repeats=1)
    (row,) = rows
    assert row["plat"]["backends"] == {"eager": 2}  # forward and forward + backward, one p != 2 head group
    assert row["plat"]["fwd_ms"] > 0 and row["plat"]["fwd_bwd_peak_mib"] is None  # peak memory: CUDA only
    ratio = row["ratio_to_sdpa"]  # one round: its ratio, the median and the range alike
    assert ratio["fwd_bwd"] == pytest.approx(row["plat"]["fwd_bwd_ms"] / row["sdpa"]["fwd_bwd_ms"])
    assert ratio["fwd_range"] == (ratio["fwd"], ratio["fwd"]) and ratio["fwd_bwd_range"][1] == ratio["fwd_bwd"]
    assert "unavailable" in row["sdpa-cudnn"] and "ratio_to_sdpa-cudnn" not in row  # no cuDNN on a CPU
    assert "failures" not in row


def test_a_failed_plat_call_fails_the_row_and_a_failed_baseline_is_unavailable():
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))

    def refused():
        raise ValueError("no backend for this input")

    calls = {"plat": (refused, (3, 11)), "sdpa": (lambda: q * k * v, (2, 7)), "other": (refused, (2, 7))}
    timings, ratios = attention_timings(calls, (q, k, v), torch.ones(q.shape), 1, CPU, warmup=0, repeats=2)
    fields = timed_fields(timings, ratios)
    assert fields["failures"] == ["ValueError: no backend for this input"] and "plat" not in fields
    assert fields["other"] == {"unavailable": "ValueError: no backend for this input"}
    assert fields["sdpa"]["fwd_bwd_ms"] > 0 and not ratios


def test_kernel_times_by_name_and_launch_order():
    """On a CPU the profiled events are operators: every matmul of the call, in launch order."""
    a, b = torch.randn(64, 64), torch.randn(8, 8)
    times = kernel_times(lambda: (a @ a, b @ b, a @ a), CPU, repeats=3)
    assert times["aten::mm"]["launches"] == 3 and len(times["aten::mm"]["launch_us"]) == 3
    assert times["aten::mm"]["us"] > 0 and all(us > 0 for us in times["aten::mm"]["launch_us"])
    calls = iter(range(10))
    with pytest.raises(RuntimeError, match="times in 2 calls"):  # a kernel that only some calls run
        kernel_times(lambda: a @ a if next(calls) % 2 else None, CPU, repeats=2)


def test_kernels_section_on_cpu():
    cases = {"tiny": KernelCase((1, 2, 24, 8, True)), "tiny-p1.5": KernelCase((1, 2, 24, 8, True), 1.5),
             "tiny-tokens": KernelCase((1, 2, 24, 8, True), values="tokens")}  # fmt: skip
    variants = {"uncapped": (("tiny",), uncapped)}
    mixed, single, tokens, again = kernels_section(CPU, no_log, cases=cases, repeats=2, variants=variants)
    assert mixed["p"] == [1.5, 2.5] and single["p"] == [1.5]
    assert mixed["values"] == "random" and tokens["values"] == "tokens" and "failures" not in tokens
    assert again["name"] == "tiny-uncapped" and again["variant"] == "uncapped" and "variant" not in mixed
    assert "failures" not in again and again["kernels"]
    assert mixed["config"] is None  # the interpreter's tiles on a CPU
    # The variant's kernels against the adopted row's, each by name and in all.
    assert set(again["to_adopted"]) == (set(again["kernels"]) & set(mixed["kernels"])) | {"total"}
    assert again["to_adopted"]["total"] == again["total_us"] / mixed["total_us"]
    assert all(again["to_adopted"][name] == again["kernels"][name]["us"] / mixed["kernels"][name]["us"]
               for name in again["kernels"])  # fmt: skip
    assert "to_adopted" not in mixed and "to_adopted" not in single
    # Two calls timed for the host, two profiled for it, then a warm-up and two profiled for the kernels.
    assert "failures" not in mixed and mixed["backends"] == {"eager": 7}
    assert mixed["total_us"] == sum(kernel["us"] for kernel in mixed["kernels"].values()) > 0
    assert mixed["kernels"]["aten::bmm"]["launches"] >= 1
    assert mixed["host"]["call_us"] > 0 and mixed["host"]["launches"] == 0  # eager: no Triton launch
    functions = mixed["host_profile"]["functions"]
    assert 0 < len(functions) <= HOST_PROFILE_TOP
    assert [f["own_us"] for f in functions] == sorted((f["own_us"] for f in functions), reverse=True)
    assert sum(f["own_us"] for f in functions) <= mixed["host_profile"]["own_us"]


def test_token_values_repeat_as_a_text_s_tokens():
    """Nearly every block of 64 queries holds a query whose value equals an earlier key's: a pair that the exact passes
    take. Each head has its own vectors."""
    values = token_values(2, 3, 1024, 8, CPU, torch.Generator().manual_seed(1))
    assert values.shape == (2, 3, 1024, 8) and values.dtype == torch.bfloat16 and values.is_contiguous()
    equal = (values[:, :, :, None] == values[:, :, None, :]).all(-1)  # (B, H, N, N)
    repeats = torch.tril(equal, diagonal=-1).any(-1)  # a query's value equals an earlier key's
    assert repeats.view(2, 3, 16, 64).any(-1).float().mean() > 0.9
    assert repeats.float().mean() < 0.9  # not all one token
    assert equal[:, 0].equal(equal[:, 1]) and not values[:, 0].equal(values[:, 1])  # the same tokens, other vectors


def test_a_variant_is_compared_only_with_its_own_case_s_timed_row():
    def timed(name, forward, backward, **fields):
        kernels = {"fwd": dict(us=forward), "bwd": dict(us=backward)}
        return dict(name=name, kernels=kernels, total_us=forward + backward, **fields)

    adopted, other = timed("4k", 10.0, 30.0), timed("16k", 1.0, 1.0)
    variant = timed("4k-wide", 5.0, 45.0, variant="wide")
    assert against_adopted(variant, [other, adopted, variant])
    assert variant["to_adopted"] == {"fwd": 0.5, "bwd": 1.5, "total": 1.25}
    failed = dict(name="4k", error="RuntimeError: out of memory")
    again = timed("4k-wide", 5.0, 45.0, variant="wide")
    assert not against_adopted(again, [failed, again]) and "to_adopted" not in again
    assert not against_adopted(adopted, [adopted, variant])  # not a variant


@pytest.mark.skipif(not triton_module.INTERPRETED, reason="the Triton backend runs on CPU only under the interpreter")
@pytest.mark.parametrize("formulation", ["paper", "euler"])
def test_host_times_count_the_triton_launches(formulation):
    q, k, v = (torch.randn(1, 2, 24, 8, requires_grad=True) for _ in range(3))

    def call():
        out = plap_attention(q, k, v, (1.5, 2.5), is_causal=True, backend="triton", formulation=formulation)
        torch.autograd.grad(out.sum(), (q, k, v))

    host = host_times(call, CPU, repeats=2)
    # One launch for both p: a call this small runs each kernel's exact pass alone, the forward's, dQ's (which computes
    # the row statistics of either formulation) and dK/dV's.
    assert host["launches"] == 3 and 0 < host["launch_us"] < host["call_us"]
    assert triton_module._run.__name__ == "_run"  # restored


@pytest.mark.parametrize("variant", sorted(CONFIG_VARIANTS))
def test_changed_launch_configs_apply_a_variant_while_inside(variant):
    """Each variant changes what its cases launch with, on the H200 the kernels section runs on; calls' kept
    configurations follow it inside and return to the adopted ones after."""
    cases, change = CONFIG_VARIANTS[variant]
    _, _, _, head_dim, _ = KERNEL_CASES[cases[0]].shape
    adopted = triton_module.launch_config(torch.bfloat16, head_dim, head_dim, (9, 0))
    assert change(adopted) != adopted
    with changed_launch_configs(change):
        changed = triton_module.launch_config(torch.bfloat16, head_dim, head_dim, (9, 0))
        assert triton_module.launch_config(torch.bfloat16, 16, 16, (7, 5)) is None  # no configuration stays none
    assert changed == change(adopted)
    assert triton_module.launch_config(torch.bfloat16, head_dim, head_dim, (9, 0)) == adopted  # restored
    arguments = ((1.5, 2.5), 1e-6, "paper", torch.bfloat16, head_dim, head_dim, (9, 0), None, None)
    flat = triton_module._kernel_arguments(*arguments)[-1]
    with changed_launch_configs(change):
        assert triton_module._kernel_arguments(*arguments)[-1] == triton_module._flat(changed)
    assert triton_module._kernel_arguments(*arguments)[-1] == flat == triton_module._flat(adopted)


def test_the_variants_change_what_they_name():
    """uncapped: every register cap off, nothing else; wide: the query blocks and tiles at head size 256 doubled (dQ's
    with twice the warps), nothing else; split: wide's forward and dQ, dK/dV's first-pass blocks doubled and its exact
    pass on the adopted ones."""
    capped = triton_module.launch_config(torch.bfloat16, 64, 64, (9, 0))
    assert any(kernel.max_registers for kernel in capped)  # the first passes' caps on sm_90
    assert uncapped(capped) == type(capped)(*(kernel._replace(max_registers=0) for kernel in capped))
    adopted = triton_module.launch_config(torch.bfloat16, 256, 256, (9, 0))
    wide = wide_256(adopted)
    assert all(new.block_m == 2 * old.block_m for new, old in zip(wide, adopted))
    assert wide.dq.num_warps == 2 * adopted.dq.num_warps
    assert wide.fwd._replace(block_m=adopted.fwd.block_m) == adopted.fwd
    assert wide.dkdv._replace(block_m=adopted.dkdv.block_m) == adopted.dkdv
    assert wide.dq._replace(block_m=adopted.dq.block_m, num_warps=adopted.dq.num_warps) == adopted.dq
    split = split_256(adopted)
    assert (split.fwd, split.dq) == (wide.fwd, wide.dq)
    assert split.dkdv == adopted.dkdv._replace(block_n=2 * adopted.dkdv.block_n, exact_block=adopted.dkdv.block_n)


@pytest.mark.skipif(not triton_module.INTERPRETED and not torch.cuda.is_available(),
                    reason="the Triton backend needs a GPU or the interpreter")
def test_launch_costs_time_one_launch_each_way(monkeypatch):
    """The call's first launch, ``count`` times per round through the backend; bound variants where it binds (a GPU)."""
    q, k, v = (torch.randn(1, 2, 24, 8, device=DEVICE, requires_grad=True) for _ in range(3))
    launched = []
    real_bound = triton_module._BOUND

    class CountingLaunches:
        compiled = real_bound.compiled

        def __call__(self, launch):
            launched.append(launch.kernel)
            real_bound(launch)

    monkeypatch.setattr(triton_module, "_BOUND", CountingLaunches())

    def call():
        out = plap_attention(q, k, v, (1.5, 2.5), is_causal=True, backend="triton")
        torch.autograd.grad(out.sum(), (q, k, v))

    costs = launch_costs(call, q.device, rounds=2, count=3)
    bound = {"compiled_run", "plat_python"} if real_bound.enabled else set()
    measured = set(costs) - {"c_launcher"}  # Triton 3.6's C launcher, on a GPU
    assert measured == {"plat", "triton_jit", "aten_launch", "aten_empty"} | bound and (bound or len(costs) == 4)
    assert all(us > 0 for us in costs.values())
    # The recorded call's 3 launches, then the forward's first kernel 2 x 3 times through the backend's launch (and as
    # many times with its launcher a no-op, where it binds).
    forward_kernel = launched[0]
    assert len(launched) == 3 + 2 * 3 * (1 + bool(bound)) and launched[3:] == [forward_kernel] * (len(launched) - 3)
    assert triton_module._run.__name__ == "_run"  # restored
    assert all(type(entry[0]).__name__ != "_NoRun" for entry in real_bound.compiled.values())


@pytest.mark.skipif(not triton_module.INTERPRETED, reason="the Triton backend runs on CPU only under the interpreter")
def test_host_profile_names_the_functions_of_a_call():
    q, k, v = (torch.randn(1, 2, 24, 8, requires_grad=True) for _ in range(3))
    calls = []

    def call():
        calls.append(1)
        out = plap_attention(q, k, v, (1.5, 2.5), is_causal=True, backend="triton")
        torch.autograd.grad(out.sum(), (q, k, v))

    profile = host_profile(call, CPU, repeats=3, top=1000)
    assert len(calls) == 3
    by_name = {function["function"]: function for function in profile["functions"]}
    forward = by_name[next(name for name in by_name if name.startswith("modeling_plat/plap_attention_triton.py")
                           and name.endswith("(_fused_forward)"))]  # fmt: skip
    assert forward["calls"] == 1 and 0 < forward["own_us"] <= forward["cumulative_us"]
    assert any(name.endswith("(_fused_backward)") for name in by_name)
    assert profile["own_us"] == pytest.approx(sum(function["own_us"] for function in profile["functions"]))


def test_side_by_side_rotates_the_order_and_leaves_out_a_step_that_raised():
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    calls = []

    def step(name, fails_at_call=None):
        def run():
            calls.append(name)
            if calls.count(name) == fails_at_call:
                raise RuntimeError("out of memory")
            if name == "a":
                plap_attention(q, k, v, (1.5, 2.5), backend="tiled")

        return run

    results = side_by_side({"a": step("a"), "b": step("b"), "c": step("c", fails_at_call=3)}, CPU, warmup=1,
                           repeats=3)  # fmt: skip
    # Rounds: a b c (warm-up), b c a, c a b (c raises), then b a: each name leads once in turn.
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "b", "a"]
    assert len(results["a"]["seconds"]) == len(results["b"]["seconds"]) == 3
    assert all(seconds > 0 for seconds in results["a"]["seconds"])
    assert results["a"]["backends"] == {"tiled": 4} and results["b"]["backends"] == {}  # warm-up included
    assert results["c"]["error"] == "RuntimeError: out of memory" and "seconds" not in results["c"]


def test_paired_ratio_is_the_median_of_each_rounds_ratio():
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == (2.0, (2.0, 3.0))
    # A slow round of both (the GPU's clock, the host busy) moves neither the ratio nor its range.
    assert paired_ratio([2.0, 40.0, 6.0], [1.0, 20.0, 3.0]) == (2.0, (2.0, 2.0))
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])


def test_train_section_on_cpu():
    rows = train_section(CPU, no_log, batches={"ptb": 2}, warmup=0, repeats=2, host_repeats=1)
    assert [row["name"] for row in rows] == ["plat-ptb-tiny", "softmax-ptb-tiny"]
    plat, softmax = rows
    assert plat["step_ms"] > 0 and plat["baseline"] == "softmax-ptb-tiny" and softmax["ratio"] == 1.0
    low, high = plat["ratio_range"]
    assert 0 < low <= plat["ratio"] <= high and softmax["ratio_range"] == (1.0, 1.0)
    # Where a step's time goes: the host's part, and (on a CPU) the operators it runs, more for p-LaT's backends.
    assert plat["host"]["call_us"] > 0 and plat["host"]["launches"] == 0  # no Triton launch on a CPU
    for row in rows:  # each step's host profile, its own functions among the top ones
        functions = row["host_profile"]["functions"]
        assert functions and all(function["calls"] > 0 for function in functions)
        assert any(function["function"].startswith("modeling_plat/") for function in functions)
    assert plat["work"]["kernels"] > softmax["work"]["kernels"] > 0 and plat["work"]["kernel_us"] > 0
    assert set(plat["backends"]) <= {"eager", "tiled"} and sum(plat["backends"].values()) >= 4  # every layer
    assert softmax["backends"] == {}  # p = 2: SDPA, no choice made


def test_other_kernels_of_a_call_are_the_ones_not_of_p_lat():
    kernels = {"plap_forward_kernel": dict(launches=2, us=40.0), "triton_poi_fused_clone_0": dict(launches=1, us=1.5),
               "vectorized_elementwise_kernel": dict(launches=3, us=2.25)}
    assert other_kernels(kernels) == dict(launches=4, us=3.75,
                                          names=["triton_poi_fused_clone_0", "vectorized_elementwise_kernel"])


def test_compile_section_on_cpu(tmp_path):
    """A one-layer plat-ptb-tiny, so that tracing takes seconds."""
    preset = tmp_path / "config.json"
    config = json.loads(Path(resolve_config_name("plat-ptb-tiny")).read_text())
    preset.write_text(json.dumps(dict(config, num_hidden_layers=1, hidden_size=32, intermediate_size=64)))
    rows = compile_section(CPU, no_log, presets=(str(preset),), cuda_graphs_preset=str(preset),
                           compiler="aot_eager", batch=2, warmup=1, repeats=1, new_tokens=3,
                           attention_shapes={"tiny": (2, 2, 24, 16, True)})  # fmt: skip
    paper, euler, static, step, graphs, generate = rows
    for row, name in ((paper, "paper"), (euler, "euler"), (static, "paper-static-launch")):
        assert row["name"] == f"tiny/attention-{name}" and not row["failures"], row
        assert row["static_launch"] == (row is static)
        assert row["graph_breaks"] == 0 and row["graphs"] == 1 and sum(row["backends"].values()) == 1
        assert set(row["errors"]) == {"out", "grad_q", "grad_k", "grad_v"}
        assert all(error <= row["tolerance"] for error in row["errors"].values())
        timing = row["timing"]  # one round, side by side
        assert timing["ratio_range"][0] == timing["ratio_to_eager"] == timing["ratio_range"][1] > 0, timing
        assert timing["step_ms"] > 0 and timing["eager_ms"] > 0 and timing["backends"] == {}, timing  # traced once
        assert all(kernel.startswith("plap_") for kernel in timing["plap_kernel_us"]), timing  # CUDA kernels only
        assert set(timing["other_kernels"]) == {"compiled", "eager"}, timing
    assert "error" not in step and step["graph_breaks"] == 0 and step["graphs"] == 1, step
    (chosen,) = step["backends"]  # the backend compiled in is the one eager runs
    assert step["ratio_to_eager"] > 0 and step["backends"] == {chosen: 1}  # 3 calls, counted once while tracing
    assert step["ratio_range"][0] == step["ratio_to_eager"] == step["ratio_range"][1]  # one round, side by side
    assert step["eager"]["backends"] == {chosen: 2}  # counted per call: warm-up, timed step
    assert graphs["skipped"] == "CUDA graphs need a CUDA device"
    assert "error" not in generate and generate["graph_breaks"] == 0 and generate["tokens_equal_eager"], generate
    assert generate["graphs"] == 3  # the prompt, the first step, then one graph for every cache length


def test_decode_section_on_cpu():
    rows = decode_section(CPU, no_log, shapes=("gpt2",), batch_sizes=(1,), new_tokens=3, repeats=1,
                          dtype=torch.float32)  # fmt: skip
    assert [row["model"] for row in rows] == ["plat-gpt2", "softmax-gpt2", "transformers-sdpa"]
    assert all(row["tokens_per_s"] > 0 and "ratio_to_transformers" in row for row in rows)
    assert "decode" in rows[0]["backends"]


FAKE_JOB = """import json, sys, pathlib
out = pathlib.Path(sys.argv[sys.argv.index("--output_dir") + 1])
{body}
"""


@pytest.mark.parametrize("body, timeout_s, failures", [
    ("out.mkdir(parents=True); (out / 'all_results.json').write_text(json.dumps({'test_perplexity': 236.1}))", 60, None),
    ("print('Traceback: no data'); sys.exit(3)", 60, ["exit status 3, no all_results.json"]),
    ("import time; time.sleep(30)", 1, ["timed out after 1 s"]),
])  # fmt: skip
def test_main_job_section_records_metrics_or_failures(tmp_path, body, timeout_s, failures):
    script = tmp_path / "job.py"
    script.write_text(FAKE_JOB.format(body=body))
    (row,) = main_job_section(CPU, no_log, timeout_s=timeout_s, script=script)
    assert row.get("failures") == failures and row["wall_s"] > 0
    assert " plat-ptb-tiny.yaml --output_dir " in row["command"]
    if failures is None:
        assert row["metrics"] == {"test_perplexity": 236.1}
    elif "exit" in failures[0]:
        assert "no data" in row["output_tail"]


def test_main_job_arguments_are_run_clms():
    from transformers import HfArgumentParser

    from plat_train.arguments import PlatTrainingArguments, parse_args
    from plat_train.causal_lm import TextDataArguments, TextModelArguments

    parser = HfArgumentParser((TextModelArguments, TextDataArguments, PlatTrainingArguments))
    argv = main_job_arguments("/tmp/plat-ptb-tiny", torch.device("cuda"))
    assert argv[-2:] == ["--bf16", "true"]
    model, data, training = parse_args(parser, argv[:-2])  # bf16 is checked against the machine
    assert (model.config_name, training.max_steps, training.output_dir) == ("plat-ptb-tiny", 450, "/tmp/plat-ptb-tiny")


class FakeClock:
    def __init__(self):
        self.now, self.lines = 0.0, []

    def elapsed(self):
        return self.now

    def __call__(self, line):
        self.lines.append(line)


def test_budget_guard_errors_and_saving():
    clock, saved = FakeClock(), []

    def advance(seconds, rows):
        clock.now += seconds
        return rows

    def broken():
        raise RuntimeError("illegal memory access")

    runs = [("sweep", lambda: advance(50, [{"case": "a", "failures": []}])), ("attention", broken),
            ("train", lambda: advance(30, [])), ("compile", lambda: advance(1, [])), ("main-job", lambda: [])]
    expected = dict(sweep=60, attention=10, train=20, compile=30, **{"main-job": 5})
    results = gpu_check.run_sections(runs, 100, clock, lambda done: saved.append(dict(done)), expected)
    assert [results[name]["status"] for name, _ in runs] == ["ok", "error", "ok", "skipped", "ok"]
    assert results["sweep"]["rows"] == [{"case": "a", "failures": []}] and results["sweep"]["seconds"] == 50
    assert results["attention"]["failures"] == ["RuntimeError: illegal memory access"]
    assert results["compile"]["reason"] == "budget: 80 s used + about 30 s expected > 100 s"
    assert [list(done) for done in saved] == [[name for name, _ in runs[:i]] for i in range(1, 6)]
    assert any("section compile skipped" in line for line in clock.lines)


def section(*rows):
    return dict(status="ok", rows=list(rows))


def test_the_sweep_leaves_the_sections_after_it_their_expected_time():
    expected = dict(sweep=150, attention=20, train=45)
    assert gpu_check.sweep_seconds(500, 100, ["sweep", "attention", "train"], expected) == 500 - 100 - 20 - 45
    assert gpu_check.sweep_seconds(300, 100, ["sweep", "attention", "train"], expected) == 150  # its own at least
    assert gpu_check.sweep_seconds(500, 100, ["attention", "train", "sweep"], expected) == 400  # last: what is left


def test_targets_and_failures():
    fused = {"triton": 8}
    sections = dict(
        attention=section(dict(name="paper-lm", plat=dict(backends=fused), ratio_to_sdpa=dict(fwd=3.0, fwd_bwd=2.4))),
        train=section(dict(name="plat-deit-tiny", ratio=1.1, backends=fused),
                      dict(name="plat-lm", ratio=1.3, backends=fused),
                      dict(name="plat-llama-125m", ratio=1.4, backends=fused),
                      dict(name="llama-125m-sdpa", ratio=1.0, backends={})),
        compile=section(*[dict(name=f"{preset}/{kind}", kind=kind, graph_breaks=0, backends=fused)
                          for preset in COMPILE_PRESETS for kind in ("train-step", "generate")],
                        dict(name="plat-ptb-tiny/train-step-cuda-graphs", kind="train-step-cuda-graphs",
                             error="RuntimeError: x", failures=["RuntimeError: x"])),
        decode=section(dict(name="gpt2/plat-gpt2/batch1", backends={"decode": 3, "tiled": 1})),
    )  # fmt: skip
    sections["compile"]["rows"][0]["ratio_to_eager"] = 0.7
    # Kernel speed: the 4k forward within its 2.0x, forward + backward not within 2.5x; 16k over 1.2x SDPA's memory.
    for name, ratios, peaks in [("4k", (1.9, 2.6), (98, 97)), ("4k-d128", (2.1, 2.9), (190, 180)),
                                ("16k", (2.2, 2.4), (130, 97))]:  # fmt: skip
        sections["attention"]["rows"].append(dict(name=name, plat=dict(backends=fused, fwd_bwd_peak_mib=peaks[0]),
                                                  sdpa=dict(fwd_bwd_peak_mib=peaks[1]),
                                                  ratio_to_sdpa=dict(fwd=ratios[0], fwd_bwd=ratios[1])))  # fmt: skip
    targets = judge_targets(sections, ["attention", "train", "compile", "decode"])
    assert [target["passed"] for target in targets] == [True, False, False, True, True, False, True, True, False,
                                                        True, True, False, False]  # fmt: skip
    assert targets[0]["line"] == ("PASS deit-tiny training step <= 1.2 x ViTForImageClassification (SDPA), bf16 "
                                  "autocast: 1.1")
    assert targets[2]["line"].startswith("FAIL llama-125m training step <= 1.3") and targets[2]["value"] == 1.4
    assert targets[4]["line"] == "PASS 4k attention forward <= 2.0 x SDPA (default backend): 1.9"
    assert targets[8]["value"] == {"4k": 1.01, "4k-d128": 1.056, "16k": 1.34}
    assert "gpt2/plat-gpt2/batch1" in targets[12]["value"]
    failures = collect_failures(sections, targets)
    assert failures[0] == "compile plat-ptb-tiny/train-step-cuda-graphs: RuntimeError: x"
    assert len(failures) == 1 + 6
    # Peak memory is judged only when every shape measured it.
    del sections["attention"]["rows"][-1]["sdpa"]
    assert peak_memory_target(sections) == ({"4k": 1.01, "4k-d128": 1.056}, None)
    # Only the requested sections' targets; a requested section that did not run measures nothing.
    skipped = dict(train=dict(status="skipped", reason="budget"))
    (only,) = judge_targets(skipped, ["train"])[:1]
    assert only["passed"] is None and only["line"].startswith("NOT MEASURED")
    assert judge_targets({}, ["sweep"]) == []


def test_record_path_and_report(tmp_path):
    path = gpu_check.record_path(tmp_path, "NVIDIA H100 80GB HBM3", "2026-11-26")
    assert path == tmp_path / "gpu_check-h100-80gb-hbm3-2026-11-26.json"
    assert gpu_check.record_path(tmp_path / "x.json", "NVIDIA H200", "2026-11-26") == tmp_path / "x.json"
    report = dict(environment=dict(gpu="fake"), sections=dict(sweep=section()), failures=[])
    assert json.loads(gpu_check.write_report(tmp_path / "new" / "r.json", report).read_text()) == report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_gpu_exits_with_a_message(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_envelope_section_on_cpu():
    """Each pattern reaches p-LaT and SDPA alike: a window and packed rows, their ratios recorded."""
    shapes = {"window": (1, 2, 64, 16, dict(sliding_window=16)), "packed": (1, 2, 64, 16, dict(documents=(30, 34)))}
    rows = envelope_section(CPU, no_log, shapes=shapes, warmup=0, repeats=1)
    assert [row["name"] for row in rows] == ["window", "packed"]
    for row in rows:
        assert "error" not in row and row["plat"]["fwd_bwd_ms"] > 0 and row["ratio_to_sdpa"]["fwd_bwd"] > 0
        assert sum(row["plat"]["backends"].values()) > 0
        assert "unavailable" in row.get("flash-window", {"unavailable": "not a window"})  # no flash_attn here


def test_fallback_section_on_cpu():
    rows = fallback_section(CPU, no_log, shapes={"tiny": (1, 2, 48, 16)}, warmup=0, repeats=1)
    assert rows[0]["faster"] in ("eager", "tiled")
    assert rows[0]["eager"]["fwd_bwd_ms"] > 0 and rows[0]["tiled"]["fwd_bwd_ms"] > 0
    assert rows[0]["eager"]["backends"] == {"eager": 2} and rows[0]["tiled"]["backends"] == {"tiled": 2}


def sleep_a_minute(case):
    time.sleep(60)


def test_sweep_workers_stop_at_its_time_budget():
    """Cases still running in the workers when the budget runs out are killed, not waited for (at the interpreter's
    exit either): the rest of the run keeps its time."""
    cases = [case for case in sweep_cases() if case["kind"] == "backend"][:2]
    start = time.monotonic()
    results = run_sweep(cases, sleep_a_minute, no_log, workers=2, seconds=5)
    assert [r["status"] for r in results] == ["skipped", "skipped"]
    while multiprocessing.active_children() and time.monotonic() - start < 30:
        time.sleep(0.1)
    assert not multiprocessing.active_children() and time.monotonic() - start < 30


def test_sweep_stops_at_its_time_budget():
    """Cases not run within the sweep's seconds are reported skipped, not failed, and not run."""
    ran = []

    def slow(case):
        ran.append(case)
        time.sleep(0.2)
        return ok_result()

    cases = [case for case in sweep_cases() if case["kind"] == "backend"][:4]
    results = run_sweep(cases, slow, no_log, seconds=0.3)
    assert [r["status"] for r in results] == ["ok", "ok", "skipped", "skipped"] and len(ran) == 2
    assert all(not r["failures"] for r in results)


@pytest.mark.skipif(not triton_module.INTERPRETED, reason="the variants' tiles are sm_90's; a CPU runs any under the "
                                                          "interpreter")  # fmt: skip
@pytest.mark.parametrize("variant", ["wide", "split"])
def test_the_head_size_256_variants_compute_eq_12(request, variant):
    """The variants' tiles at head size 160 (bucket 256), under the interpreter: outputs and gradients against the
    float64 reference, causal with key padding, key 20's value repeated at query 40 (a pair for the exact passes;
    test_repeated_values checks that the backward finds the forward's flags at its tiles). wide: the forward's and
    dQ's blocks of 32 queries against tiles of 32 keys, dK/dV's blocks of 16 keys against tiles of 64 queries, each
    kernel's exact pass alone, as a call this small runs them; split: dK/dV's first pass on blocks of 32 keys and its
    exact pass on the flagged ones' halves, both passes run."""
    _, change = CONFIG_VARIANTS[variant]
    config = change(triton_module.launch_config(torch.bfloat16, 256, 256, (9, 0)))
    assert (config.fwd.block_m, config.fwd.block_n, config.dq.block_m) == (32, 32, 32)
    assert (config.dkdv.block_n, config.dkdv.exact_block) == ((16, 0) if variant == "wide" else (32, 16))
    if variant == "split":
        request.getfixturevalue("two_passes")
    shape = (2, 2, 70, 70, 160, 160)
    inputs, p = make_inputs(*shape, torch.float16)
    with torch.no_grad():
        inputs[2][:, :, 40] = inputs[2][:, :, 20]
    run = lambda *args, **kwargs: run_triton(*args, **kwargs, config=config)  # noqa: E731
    check(run, inputs, p, torch.float16, attn_mask=make_mask("padding", *shape[:4]), is_causal=True)
