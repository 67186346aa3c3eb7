"""benchmarks/gpu_check.py's precompilation on CPU (gpu_sections/precompile.py): each section's rows, once and untimed,
side by side in spawned processes, whose compilations the sections' own runs then find in the caches on disk."""

import functools
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch._inductor.config

import gpu_check
from gpu_sections.attention import attention_row, row_jobs
from gpu_sections.kernels import KernelCase, kernels_jobs, uncapped
from gpu_sections.measure import no_log
from gpu_sections.models import compile_jobs, train_jobs
from gpu_sections.precompile import COMPILE_THREADS, precompile

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
TINY = (1, 2, 24, 8, True)


def test_precompile_runs_each_row_in_a_spawned_process_and_records_what_became_of_it():
    jobs = [("fine", functools.partial(time.sleep, 0)), ("raises", functools.partial(int, "x"))]
    result = precompile(jobs, workers=2, seconds=120)
    assert list(result["jobs"]) == ["fine", "raises"]
    assert isinstance(result["jobs"]["fine"], float) and 0 <= result["jobs"]["fine"] <= result["seconds"]
    assert result["jobs"]["raises"] == "ValueError: invalid literal for int() with base 10: 'x'"
    assert not multiprocessing.active_children()  # the workers are done and gone


def test_precompile_refuses_to_run_its_rows_in_this_process():
    threads = torch._inductor.config.compile_threads
    with pytest.raises(ValueError, match="workers must be at least 1, not 0"):
        precompile([("raises", functools.partial(int, "x"))], workers=0)
    assert torch._inductor.config.compile_threads == threads


def compiles_with_few_processes():
    assert 1 <= torch._inductor.config.compile_threads <= COMPILE_THREADS


def test_precompile_s_processes_compile_with_few_processes_each(monkeypatch):
    """Inductor's pool of compile processes, one per core, in each of precompilation's processes would put workers x
    cores processes on the host."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", str(COMPILE_THREADS + 3))  # what a larger host would take
    result = precompile([("few", compiles_with_few_processes)], workers=1, seconds=120)
    assert isinstance(result["jobs"]["few"], float), result


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
        kernels=kernels_jobs(CPU, cases={"tiny": KernelCase(TINY)}, variants={"uncapped": (("tiny",), uncapped)}),
        train=train_jobs(CPU, batches={"ptb": 2}),
        compile=compile_jobs(CPU, presets=("preset",), cuda_graphs_preset="preset",
                             attention_shapes={"tiny": (2, 2, 24, 16, True)}),
    )  # fmt: skip
    assert {name: [label for label, _ in jobs] for name, jobs in sections.items()} == dict(
        attention=["attention tiny"], kernels=["kernels tiny", "kernels tiny-uncapped"], train=["train ptb"],
        compile=["compile tiny/attention-paper", "compile tiny/attention-euler",
                 "compile tiny/attention-paper-static-launch", "compile preset/train-step",
                 "compile preset/train-step-cuda-graphs", "compile preset/generate"],
    )  # fmt: skip
    for jobs in sections.values():
        for _, run in jobs:
            assert pickle.loads(pickle.dumps(run)).func is run.func
    ((_, run),) = sections["attention"]
    row = run()  # as the attention section's, from one untimed round
    assert row["name"] == "tiny" and "error" not in row and row["plat"]["backends"], row
    ((_, again),) = [job for job in sections["kernels"] if job[0] == "kernels tiny-uncapped"]
    row = again()
    assert row["name"] == "tiny-uncapped" and row["variant"] == "uncapped" and "error" not in row, row


def test_the_sections_a_run_precompiles_and_what_it_then_expects_of_them():
    """Precompilation runs the jobs of the requested sections that have some, those of the longest rows first, and
    names the sections whose every row finished there: those the budget guard then expects to take their PRECOMPILED_S
    (less than their EXPECTED_S)."""
    jobs = dict(attention=lambda: [("attention a", functools.partial(time.sleep, 0))],
                kernels=lambda: [("kernels a", functools.partial(time.sleep, 0)),
                                 ("kernels b", functools.partial(int, "x"))])  # fmt: skip
    result = gpu_check.precompiled(["sweep", "attention", "kernels"], jobs, 2, 120, no_log,
                                   expected_s=dict(attention=10, kernels=30))  # fmt: skip
    assert list(result["jobs"]) == ["kernels a", "kernels b", "attention a"]  # the longest rows first
    assert result["sections"] == ["attention"]
    failed = gpu_check.precompiled(["attention"], jobs, -1, 120, no_log)  # precompilation itself fails: recorded
    assert failed["sections"] == [] and failed["jobs"] == {} and "at least 1" in failed["error"], failed
    assert set(gpu_check.PRECOMPILED_S) <= set(gpu_check.EXPECTED_S)
    assert all(gpu_check.PRECOMPILED_S[name] < gpu_check.EXPECTED_S[name] for name in gpu_check.PRECOMPILED_S)


# A check's main script as gpu_check.py starts (multiprocessing imported before torch): it precompiles one row of the
# compile section, runs the row itself, and prints the files the row added to Inductor's cache and its cache misses.
CHECK_SCRIPT = """
import json, multiprocessing, sys
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from gpu_sections.models import compile_jobs
from gpu_sections.precompile import COMPILE_THREADS, precompile

def main(cache):
    (label, run), *_ = compile_jobs(torch.device("cpu"), presets=(), compiler="inductor",
                                   attention_shapes={"precompiled": (2, 2, 40, 16, True)})
    done = precompile([(label, run)], workers=1)
    before = {str(path) for path in Path(cache).rglob("*") if path.is_file()}
    row = run()
    added = {str(path) for path in Path(cache).rglob("*") if path.is_file()} - before
    print(json.dumps(dict(precompiled=done["jobs"][label], failures=row["failures"], added=sorted(added),
                          misses=counters["inductor"]["fxgraph_cache_miss"])))

if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.slow
def test_a_row_precompiled_elsewhere_leaves_its_section_nothing_to_compile(tmp_path):
    """What precompilation is for: a compile-section row run in a spawned process first compiles its graphs and their
    kernels into the caches on disk; the same row in a main script that starts as gpu_check.py then finds every graph
    there and compiles nothing (Inductor on a CPU; on a GPU also Triton's builds of the fused kernels, whose keys hold
    their source and specialization only). With multiprocessing imported after torch, the graphs miss."""
    script, cache = tmp_path / "check.py", tmp_path / "cache"
    script.write_text(CHECK_SCRIPT)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script), str(cache)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result["precompiled"], float) and not result["failures"], result
    assert result["misses"] == 0 and result["added"] == [], result  # nothing compiled, not even a graph's entry


def test_main_precompiles_the_requested_sections_then_runs_them(monkeypatch, tmp_path):
    """gpu_check.main's wiring, its GPU and sections stood in for: the rows of the requested sections precompiled, the
    sections run in order, each expected to take its PRECOMPILED_S where every row of it finished there, the sweep given
    what the sections after it leave, and the record holding precompilation."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "environment", lambda device: dict(gpu="Fake GPU", date="2026-11-30T00:00:00"))
    ran, expected = [], {}
    for name in ("sweep", "attention", "kernels", "train"):
        monkeypatch.setattr(gpu_check, f"{name}_section",
                            lambda device, log, name=name, **options: ran.append((name, options)) or [dict(name=name)])
    monkeypatch.setattr(gpu_check, "row_jobs", lambda section, row, shapes, device: [(f"{section} a", int)])
    monkeypatch.setattr(gpu_check, "kernels_jobs", lambda device: [("kernels a", int)])
    monkeypatch.setattr(gpu_check, "train_jobs", lambda device: [("train a", functools.partial(int, "x"))])
    run_sections = gpu_check.run_sections

    def recording(runs, budget_s, log, save, expected_s):
        expected.update(expected_s)
        return run_sections(runs, budget_s, log, save, expected_s)

    monkeypatch.setattr(gpu_check, "run_sections", recording)
    out = tmp_path / "record.json"
    gpu_check.main(["--sections", "sweep", "attention", "kernels", "train", "--workers", "1", "--budget-s", "1000",
                    "--out", str(out)])  # fmt: skip
    record = json.loads(out.read_text())
    longest_first = sorted(("attention", "kernels", "train"), key=lambda name: -gpu_check.EXPECTED_S[name])
    assert list(record["precompile"]["jobs"]) == [f"{name} a" for name in longest_first]  # one row each
    assert record["precompile"]["sections"] == ["attention", "kernels"]  # train's row failed there
    assert [expected[name] for name in ("attention", "kernels", "train")] == [
        gpu_check.PRECOMPILED_S["attention"], gpu_check.PRECOMPILED_S["kernels"], gpu_check.EXPECTED_S["train"]]
    assert [name for name, _ in ran] == ["sweep", "attention", "kernels", "train"]
    sweep_seconds = ran[0][1]["seconds"]
    assert 1000 - sum(expected[name] for name in ("attention", "kernels", "train")) - 60 < sweep_seconds
    assert sweep_seconds <= 1000 - sum(expected[name] for name in ("attention", "kernels", "train"))
    assert all(record["sections"][name]["status"] == "ok" for name in ("sweep", "attention", "kernels", "train"))
