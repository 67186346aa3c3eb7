"""benchmarks/gpu_check.py's precompilation on CPU (gpu_sections/precompile.py): each section's rows, once and untimed,
side by side in spawned processes, whose compilations the sections' own runs then find in the caches on disk."""

import functools
import multiprocessing
import pickle
import time

import pytest
import torch

import gpu_check
from gpu_sections.attention import attention_row, row_jobs
from gpu_sections.kernels import kernels_jobs
from gpu_sections.models import compile_jobs, train_jobs
from gpu_sections.precompile import precompile

CPU = torch.device("cpu")
TINY = (1, 2, 24, 8, True)


def quiet(line):
    pass


def test_precompile_runs_each_row_in_a_spawned_process_and_records_what_became_of_it():
    jobs = [("fine", functools.partial(time.sleep, 0)), ("raises", functools.partial(int, "x"))]
    result = precompile(jobs, workers=2, seconds=120)
    assert list(result["jobs"]) == ["fine", "raises"]
    assert isinstance(result["jobs"]["fine"], float) and 0 <= result["jobs"]["fine"] <= result["seconds"]
    assert result["jobs"]["raises"] == "ValueError: invalid literal for int() with base 10: 'x'"
    assert not multiprocessing.active_children()  # the workers are done and gone


def test_precompile_kills_what_still_runs_when_its_time_runs_out():
    start = time.monotonic()
    result = precompile([("slow", functools.partial(time.sleep, 60))], workers=1, seconds=3)
    assert result["jobs"] == {"slow": "skipped: precompilation's time ran out"}
    while multiprocessing.active_children() and time.monotonic() - start < 30:
        time.sleep(0.1)
    assert not multiprocessing.active_children() and time.monotonic() - start < 30


def test_each_section_s_jobs_are_its_rows_and_pickle():
    """A section's jobs are the rows its run makes (the same functions and arguments, no timed rounds), each of which a
    spawned process takes by pickle."""
    sections = dict(
        attention=row_jobs("attention", attention_row, {"tiny": TINY}, CPU),
        kernels=kernels_jobs(CPU, cases={"tiny": (TINY, None)}, uncapped=("tiny",)),
        train=train_jobs(CPU, batches={"ptb": 2}),
        compile=compile_jobs(CPU, presets=("preset",), cuda_graphs_preset="preset",
                             attention_shapes={"tiny": (2, 2, 24, 16, True)}),
    )  # fmt: skip
    assert {name: [label for label, _ in jobs] for name, jobs in sections.items()} == dict(
        attention=["attention tiny"], kernels=["kernels tiny", "kernels tiny-uncapped"], train=["train ptb"],
        compile=["compile tiny/attention-paper", "compile tiny/attention-euler", "compile preset/train-step",
                 "compile preset/train-step-cuda-graphs", "compile preset/generate"],
    )  # fmt: skip
    for jobs in sections.values():
        for _, run in jobs:
            assert pickle.loads(pickle.dumps(run)).func is run.func
    ((_, run),) = sections["attention"]
    row = run()  # as the attention section's, from one untimed round
    assert row["name"] == "tiny" and "error" not in row and row["plat"]["backends"], row
    ((_, uncapped),) = [job for job in sections["kernels"] if job[0] == "kernels tiny-uncapped"]
    row = uncapped()
    assert row["name"] == "tiny-uncapped" and row["register_caps"] is False and "error" not in row, row


def test_the_sections_a_run_precompiles_and_what_it_then_expects_of_them():
    """Precompilation runs the jobs of the requested sections that have some; a section whose every row finished there
    is expected to take its PRECOMPILED_S, one with a row that did not its EXPECTED_S."""
    jobs = dict(attention=lambda: [("attention a", functools.partial(time.sleep, 0))],
                kernels=lambda: [("kernels a", functools.partial(time.sleep, 0)),
                                 ("kernels b", functools.partial(int, "x"))])  # fmt: skip
    result = gpu_check.precompiled(["sweep", "attention", "kernels"], jobs, 2, 120, quiet)
    assert set(result["jobs"]) == {"attention a", "kernels a", "kernels b"}
    assert result["sections"] == ["attention"]
    assert set(gpu_check.PRECOMPILED_S) <= set(gpu_check.EXPECTED_S)
    assert all(gpu_check.PRECOMPILED_S[name] < gpu_check.EXPECTED_S[name] for name in gpu_check.PRECOMPILED_S)


@pytest.mark.slow
def test_a_row_precompiled_elsewhere_leaves_its_section_no_kernel_to_compile(tmp_path, monkeypatch):
    """What precompilation is for: a compile-section row run in a spawned process first compiles its kernels into the
    cache on disk, and the same row in this process then compiles none of its own (Inductor's C++ kernels on a CPU;
    on a GPU, Triton's builds of the fused kernels and Inductor's, cached the same way)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (label, run), _ = compile_jobs(CPU, presets=(), attention_shapes={"precompiled": (2, 2, 40, 16, True)},
                                   compiler="inductor")  # fmt: skip

    def kernels():  # the compiled kernels (the graphs' own entries are keyed per process)
        return {path for path in tmp_path.rglob("*") if path.is_file() and "fxgraph" not in path.parts}

    result = precompile([(label, run)], workers=1)
    assert isinstance(result["jobs"][label], float), result
    compiled = kernels()
    assert compiled
    row = run()
    assert not row["failures"] and kernels() == compiled
