"""The acceptance check of plat on a CUDA GPU, one run within a time budget that writes one JSON record.

Correctness, speed against SDPA and transformers' models, torch.compile, decoding and the README's main job:

    python benchmarks/gpu_check.py                     # every section; the record goes to benchmarks/results/
    python benchmarks/gpu_check.py --sections sweep attention --out /tmp/check.json

Sections, each a list of JSON rows in the record (a row that failed says why in its "failures"); their code is in
gpu_sections/ (sweep.py; attention.py: attention, envelope and fallback; kernels.py; models.py: train, compile, decode
and main-job), this script runs them within the budget and writes the record:

- sweep: ``backend="auto"`` and ``"triton"`` against the float64 eager reference on the same GPU: float32 /
  bfloat16 / float16 x head sizes 16, 48, 64, 80, 128 x paper / euler x (no mask, causal + key padding) x
  (Nq = Nk, Nq < Nk): the output and the gradients of q, k and v (relative errors within the tolerances of
  tests/attention/test_backends.py) and a second run that must be bitwise identical; the Triton cases also with
  each kernel's first pass then its exact pass (the sweep's small calls run the exact pass alone). Then values with exact
  duplicates (repeated tokens: D2 = 0 off the diagonal) and packed rows (document_ids) against each document
  alone, at head sizes 16, 64 and 128; what the kernels took in last: a causal sliding window of 50 keys with key
  padding at head sizes 16, 64 and 128, head sizes 160 and 256, and duplicates at 256; eager and tiled in float32
  on duplicates under TF32 matmuls
  (torch.backends.cuda.matmul.allow_tf32), within TF32's own error (the scores' and outputs' matmuls round to
  TF32 as the user asked; the distances must not: rounded, duplicates' D2 ~ |v|^2 2^-11 instead of 0, an O(1)
  error of the weights) or twice their errors without TF32, whichever is larger; and convert_to_plat at p = 2
  of tiny random GPT-2, Llama and ViT models against transformers' own in float32 and bfloat16 (logits). The
  cases run side by side in --workers spawned processes on the same GPU (Triton caches kernels on disk), a case of
  each group in turn, so that a sweep cut short by the budget has checked some of every group.
- attention: bfloat16 plap_attention (auto, the paper's p mix as a static tuple, as models pass it) against
  scaled_dot_product_attention's default, flash and cuDNN backends: forward, forward + backward, and the peak
  memory of a forward + backward, at the paper LM (16, 8, 256, 16, causal), DeiT-tiny (64, 3, 197, 64),
  (8, 12, 1024, 64), (2, 16, 4096, 64), (2, 16, 4096, 128) and (1, 8, 16384, 64) causal. TFLOP/s are against
  each algorithm's matmul floor (multiply-adds per score and head-size unit: p-LaT 3 forward, 11 forward +
  backward; softmax 2 and 7; causal shapes count half).
- envelope: what reached the fused kernels last, against SDPA given the same pattern as a boolean mask: a sliding
  window of 4,096 over 16k tokens (and FlashAttention-2's own window where flash_attn is installed), head size 256
  at 4k, packed rows of five documents at 4k, Llama 4's chunks of 8,192 over 16k tokens; the backends auto chose.
- kernels: the GPU kernels of one bfloat16 plap_attention forward + backward, by name, from torch.profiler: launches
  per call, microseconds per call and per launch in launch order (a kernel's first pass, then its exact pass), at the
  paper LM's and the kernel-speed shapes (4k, 4k-d128, 16k, paper mix), at 4k with every head at p = 1.5 (one
  launch per kernel): what tools/kernels/gpu_time_model.py is calibrated on; at 4k with values that repeat as a
  text's tokens do (Zipf's law over 10,000 tokens, as a RoPE model's first layer sees them: nearly every block takes
  the exact passes, which random values never reach); and at the envelope's head size 256 (2, 8, 4096, 256). Each
  row also has the host time of a call, in all and in the Triton launches (the part a synchronised call's GPU waits
  for before its first kernel), and a profile of that host time (cProfile: the functions with the most own time,
  allocations and launchers included); the paper LM's also one launch's host time by each way of launching it (the
  backend, its Python alone, Triton's compiled launcher, its C function, Triton's own ``kernel[grid]`` launch) beside
  an ATen launch and allocation. Then launch configurations measured beside the adopted ones (``CONFIG_VARIANTS``):
  4k and 16k without the first passes' register caps, as Inductor compiles the kernels (``-uncapped`` rows), and
  head size 256 with larger tiles (``d256-4k-wide``), and with those of the forward and dQ and dK/dV's first pass on
  blocks of 32 keys, its exact pass on 16 (``d256-4k-split``), each kernel's time and the total over its case's
  adopted row's (``to_adopted``). Each row on a GPU names the tiles it ran (``config``).
- train: optimizer steps (forward, backward, AdamW) under bf16 autocast of benchmarks/bench_train_step.py's
  vision (DeiT-tiny), lm (the paper's LM) and llama-125m (12 x 768, 8 x 1024 tokens) pairs, p-LaT against
  transformers' twins with SDPA (its default backend), a pair's models on the GPU together: the median step, the
  ratio to the twin, peak memory; then, over 3 more steps, where a step's time goes: its host time (in all, and in
  its Triton launches), the functions with the most host time (a profile, as the kernels rows', to compare with the
  p = 2 twin's) and the kernels it runs (how many, their time).
- compile: bfloat16 plap_attention compiled (fullgraph) against eager at the paper LM's shape and a causal 2k, each
  formulation: the output and the gradients of q, k and v within bfloat16's tolerance (the kernels as Inductor
  launches them, their written arguments functionalized) and the compiled forward + backward's time against eager's
  (``timing``, each p-LaT kernel's too: Inductor compiles the kernels without their register caps; and the call's
  other kernels in both, how many, their time and names), the paper formulation also with Inductor's own launcher for
  the kernels (``-static-launch``: not torch's default for user kernels; strict, so a kernel it cannot take fails the
  row with the reason); the plat-ptb-tiny
  and plat-llama-tiny presets' training steps under torch.compile(fullgraph=True) against eager (the first call's
  time, which precompilation shortens to what its caches leave, then steps and ratio_to_eager, graphs, graph
  breaks), the first also with mode="reduce-overhead" (CUDA graphs), and greedy generation with model.forward
  compiled (fullgraph): graphs, tokens against eager.
- fallback: where the kernels cannot run (a (B, H, N, N) mask), the eager and tiled backends' forward + backward
  time and peak memory at 512, 2k and 8k tokens: what auto should take on CUDA.
- decode: greedy decoding with the KV cache in bfloat16, benchmarks/bench_decode.py's GPT-2 and Llama shapes
  at batch 1 and 8, against transformers' models (SDPA).
- main-job: the README's main job, ``run_clm.py plat-ptb-tiny.yaml --bf16 true`` in a temporary folder: its
  wall time and final metrics (all_results.json).

Precompilation comes first: every row of the attention, envelope, kernels, train and compile sections asked for runs
once, untimed, side by side in --workers spawned processes (gpu_sections/precompile.py). A fresh machine's run is
mostly compilation (Triton's builds of the fused kernels, Inductor's of the compiled graphs), which one process does
one at a time; the processes leave what they compile in the caches on disk, where the sections' own first calls find
it. The record keeps how long precompilation took and each row there.

What a row compares runs side by side: after the warm-up, rounds of one call (or step) of each, in an order rotated
every round, so that what drifts during a run (the GPU's clocks, the host's other work) reaches each alike; a time
is the median of its rounds, a ratio the median of each round's ratio, with its range (the least and the greatest of
them: ratio_range, fwd_range, fwd_bwd_range). Every timed p-LaT row counts the backends ``auto`` chose, by name
(under torch.compile: the choices made while tracing, once per graph), so that a fall back from the fused kernels
shows. The targets are judged at the end, one PASS / FAIL / NOT MEASURED line each (gpu_sections/targets.py).
Sections run in order while the time used plus the section's expected time (EXPECTED_S, measured on H200s where a
record has the section, or PRECOMPILED_S where precompilation ran every row of the section) fits --budget-s; one that
would not is skipped with the reason. The record is rewritten after every section, so that a run stopped from outside
keeps what was done, with the GPU, driver, CUDA, torch, Triton and transformers versions and the folder modeling_plat
was imported from (a baseline's on PYTHONPATH is measured the same way). Exit status: 1
if anything failed (a check, a target, an error), 2 without a CUDA GPU.
"""

import argparse
import datetime
import json
import multiprocessing  # before torch, as in precompilation's processes (gpu_sections/precompile.py)
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

import modeling_plat
from gpu_sections.attention import (ATTENTION_SHAPES, ENVELOPE_SHAPES, attention_row, attention_section, envelope_row,
                                    envelope_section, fallback_section, row_jobs)  # fmt: skip
from gpu_sections.kernels import kernels_jobs, kernels_section
from gpu_sections.measure import ROOT, error_fields
from gpu_sections.models import (compile_jobs, compile_section, decode_section, main_job_section, train_jobs,
                                 train_section)  # fmt: skip
from gpu_sections.precompile import precompile
from gpu_sections.sweep import sweep_section
from gpu_sections.targets import collect_failures, judge_targets

SECTIONS = ("sweep", "attention", "envelope", "kernels", "train", "compile", "fallback", "decode", "main-job")
# Seconds each section is expected to take on an H100 or H200 (kernel builds and Inductor compiles dominate), which the
# budget guard adds to the time used before starting it; the sweep stops waiting for its cases when its time runs out
# (``sweep_seconds``). As measured on H200s on 2026-11-30: attention 107 s, train 69, compile 297, envelope 107,
# kernels 95 as the first section (its kernels built) and under a second after attention; its rows since add the wide
# variant's 8 kernels at head size 256 and the split variant's 4 dK/dV kernels, which no other section builds (about
# 3 s each, an estimate), and compile's two static-launch rows (Inductor's compiles of their graphs, about 15 s each,
# an estimate).
EXPECTED_S = {"sweep": 150, "attention": 110, "envelope": 110, "kernels": 85, "train": 70, "compile": 330, "fallback": 40,
              "decode": 40, "main-job": 90}
# Seconds expected of the sections whose every row ran in precompilation (``precompile``), their compilations then in
# the caches: the kernels section took 0.4 s after the attention section had built its kernels (5eb1d43's H200 record);
# the others are estimates (each section's time less what its compiles took), for the next record to replace.
PRECOMPILED_S = {"attention": 20, "envelope": 25, "kernels": 5, "train": 45, "compile": 130}
# Precompilation's share of the budget at most: side by side, its rows take about as long as the longest one.
PRECOMPILE_SHARE = 0.3


class Progress:
    """print, prefixed by the seconds since the run started (the time the budget counts)."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self):
        return time.perf_counter() - self.start

    def __call__(self, message):
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)


def run_sections(runs, budget_s, log, save, expected_s=EXPECTED_S):
    """{name: result} of running each (name, run() -> rows) in order: status "ok" with the rows, "error" (it raised),
    or "skipped" (the time used plus its expected time would pass budget_s); save(results) after each."""
    results = {}
    for name, run in runs:
        used = log.elapsed()
        if used + expected_s[name] > budget_s:
            results[name] = dict(status="skipped", reason=f"budget: {used:.0f} s used + about {expected_s[name]} s "
                                                          f"expected > {budget_s:.0f} s")  # fmt: skip
            log(f"section {name} skipped: {results[name]['reason']}")
        else:
            log(f"section {name}")
            try:
                results[name] = dict(status="ok", rows=run())
            except Exception as error:
                results[name] = dict(status="error", **error_fields(error))
            results[name]["seconds"] = log.elapsed() - used
            log(f"section {name}: {results[name]['status']} in {results[name]['seconds']:.0f} s")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        save(results)
    return results


def sweep_seconds(budget_s, used, selected, expected_s):
    """The sweep's time: what the budget leaves once the sections after it in ``selected`` have their expected seconds,
    and at least its own (a sweep takes all the time it is given: it has more cases than a budget holds)."""
    after = selected[selected.index("sweep") + 1 :]
    return max(expected_s["sweep"], budget_s - used - sum(expected_s[name] for name in after))


def precompiled(selected, jobs, workers, seconds, log, expected_s=EXPECTED_S):
    """``precompile`` of the ``selected`` sections that have ``jobs`` ({section: jobs()}), the rows of the sections
    whose rows are expected to take longest (``expected_s`` per row) started first, so that the longest compilations
    run side by side from the start; and the sections whose every row it ran ("sections")."""
    by_section = {name: jobs[name]() for name in selected if name in jobs}
    order = sorted(by_section, key=lambda name: -expected_s[name] / max(len(by_section[name]), 1))
    log(f"precompilation: {sum(map(len, by_section.values()))} rows of {', '.join(order)} in {workers} processes")
    try:
        result = precompile([job for name in order for job in by_section[name]], workers, seconds)
    except Exception as error:  # the sections then compile what they need themselves
        result = dict(jobs={}, **error_fields(error))
    result["sections"] = [name for name, section_jobs in by_section.items()
                          if all(isinstance(result["jobs"].get(label), float) for label, _ in section_jobs)]  # fmt: skip
    log(f"precompilation: {result.get('seconds', 0):.0f} s, every row of {result['sections']}; "
        + json.dumps(result.get("error") or result["jobs"]))
    return result


def environment(device):
    import transformers
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        driver = "unknown (nvidia-smi failed)"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.split("\n")  # fmt: skip
        if any(changed):  # a copied work tree: HEAD alone does not say which files ran
            commit += f" with {sum(map(bool, changed))} changed files"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (no git checkout)"
    major, minor = torch.cuda.get_device_capability(device)
    return dict(gpu=torch.cuda.get_device_name(device), capability=f"{major}.{minor}", driver=driver,
                cuda=torch.version.cuda, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, python=platform.python_version(), cpus=os.cpu_count(),
                commit=commit, modeling_plat=str(Path(modeling_plat.__file__).resolve().parent),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))  # fmt: skip


def record_path(out, gpu, date):
    """``out`` if it names a .json file, else out/gpu_check-<gpu>-<date>.json."""
    if out.suffix == ".json":
        return out
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    return out / f"gpu_check-{slug}-{date}.json"


def write_report(path, report):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                        help="the record's file (.json) or folder (default: benchmarks/results/)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="the sections to run, in this order")
    parser.add_argument("--budget-s", type=float, default=500,
                        help="skip a section when the time used plus its expected time would pass this")
    parser.add_argument("--workers", type=int, default=min(16, multiprocessing.cpu_count()),
                        help="processes of the correctness sweep (0: in this process) and of precompilation (0: none)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU and torch.cuda.is_available() is False here; on CPU the kernels "
              "are checked by the test suite (pytest) instead.", file=sys.stderr)  # fmt: skip
        return 2
    log, device = Progress(), torch.device("cuda")
    report = dict(environment=environment(device), arguments={key: str(value) for key, value in vars(args).items()})
    log(json.dumps(report["environment"]))
    path = record_path(args.out, report["environment"]["gpu"], report["environment"]["date"][:10])
    timing = dict(warmup=args.warmup, repeats=args.repeats)
    runs = {
        "sweep": lambda: sweep_section(device, log, workers=args.workers,
                                       seconds=sweep_seconds(args.budget_s, log.elapsed(), selected, expected)),
        "attention": lambda: attention_section(device, log, **timing),
        "envelope": lambda: envelope_section(device, log, **timing),
        "fallback": lambda: fallback_section(device, log),
        "kernels": lambda: kernels_section(device, log),
        "train": lambda: train_section(device, log, **timing),
        "compile": lambda: compile_section(device, log, **timing),
        "decode": lambda: decode_section(device, log),
        "main-job": lambda: main_job_section(device, log, timeout_s=args.budget_s - log.elapsed()),
    }
    jobs = {
        "attention": lambda: row_jobs("attention", attention_row, ATTENTION_SHAPES, device),
        "envelope": lambda: row_jobs("envelope", envelope_row, ENVELOPE_SHAPES, device),
        "kernels": lambda: kernels_jobs(device),
        "train": lambda: train_jobs(device),
        "compile": lambda: compile_jobs(device),
    }
    selected = list(dict.fromkeys(args.sections))
    expected = dict(EXPECTED_S)
    if args.workers and set(selected) & set(jobs):
        report["precompile"] = precompiled(selected, jobs, args.workers, args.budget_s * PRECOMPILE_SHARE, log)
        expected.update({name: PRECOMPILED_S[name] for name in report["precompile"]["sections"]})
        write_report(path, report)
    sections = run_sections([(name, runs[name]) for name in selected], args.budget_s, log,
                            lambda done: write_report(path, dict(report, sections=done)), expected)  # fmt: skip
    report.update(sections=sections, targets=judge_targets(sections, args.sections))
    report["failures"] = collect_failures(sections, report["targets"])
    report["seconds"] = log.elapsed()
    write_report(path, report)
    for target in report["targets"]:
        print(target["line"])
    for failure in report["failures"]:
        print("FAILED", failure)
    print(f"{len(report['failures'])} failures in {report['seconds']:.0f} s; record in {path}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
