"""The acceptance check of plat on a CUDA GPU, one run of under 9 minutes that writes one JSON record.

Correctness, speed against SDPA and transformers' models, torch.compile, decoding and the README's main job:

    python benchmarks/gpu_check.py                     # every section; the record goes to benchmarks/results/
    python benchmarks/gpu_check.py --sections sweep attention --out /tmp/check.json

Sections, each a list of JSON rows in the record (a row that failed says why in its "failures"):

- sweep: ``backend="auto"`` and ``"triton"`` against the float64 eager reference on the same GPU: float32 /
  bfloat16 / float16 x head sizes 16, 48, 64, 80, 128 x paper / euler x (no mask, causal + key padding) x
  (Nq = Nk, Nq < Nk): the output and the gradients of q, k and v (relative errors within the tolerances of
  tests/attention/test_backends.py) and a second run that must be bitwise identical; the Triton cases also with
  each kernel's first pass then its exact pass (the sweep's small calls run the exact pass alone). Then values with exact
  duplicates (repeated tokens: D2 = 0 off the diagonal) and packed rows (document_ids) against each document
  alone, at head sizes 16, 64 and 128; eager and tiled in float32 on duplicates under TF32 matmuls
  (torch.backends.cuda.matmul.allow_tf32), within TF32's own error (the scores' and outputs' matmuls round to
  TF32 as the user asked; the distances must not: rounded, duplicates' D2 ~ |v|^2 2^-11 instead of 0, an O(1)
  error of the weights) or twice their errors without TF32, whichever is larger; and convert_to_plat at p = 2
  of tiny random GPT-2, Llama and ViT models against transformers' own in float32 and bfloat16 (logits). The
  cases run side by side in --workers spawned processes on the same GPU (Triton caches kernels on disk).
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
  paper LM's and the kernel-speed shapes (4k, 4k-d128, 16k, paper mix) and at 4k with every head at p = 1.5 (one
  launch per kernel): what tools/kernels/gpu_time_model.py is calibrated on; and the host time of a call, in all and in
  the Triton launches (the part a synchronised call's GPU waits for before its first kernel), and a profile of that
  host time (cProfile: the functions with the most own time, allocations and launchers included).
- train: optimizer steps (forward, backward, AdamW) under bf16 autocast of benchmarks/bench_train_step.py's
  vision (DeiT-tiny), lm (the paper's LM) and llama-125m (12 x 768, 8 x 1024 tokens) pairs, p-LaT against
  transformers' twins with SDPA (its default backend); medians after warm-up, peak memory.
- compile: bfloat16 plap_attention compiled (fullgraph) against eager at the paper LM's shape and a causal 2k, each
  formulation: the output and the gradients of q, k and v within bfloat16's tolerance (the kernels as Inductor
  launches them, their written arguments functionalized); the plat-ptb-tiny and plat-llama-tiny presets' training
  steps under torch.compile(fullgraph=True)
  against eager (first-call and step times, graphs, graph breaks), the first also with mode="reduce-overhead"
  (CUDA graphs), and greedy generation with model.forward compiled (fullgraph): graphs, tokens against eager.
- fallback: where the kernels cannot run (a (B, H, N, N) mask), the eager and tiled backends' forward + backward
  time and peak memory at 512, 2k and 8k tokens: what auto should take on CUDA.
- decode: greedy decoding with the KV cache in bfloat16, benchmarks/bench_decode.py's GPT-2 and Llama shapes
  at batch 1 and 8, against transformers' models (SDPA).
- main-job: the README's main job, ``run_clm.py plat-ptb-tiny.yaml --bf16 true`` in a temporary folder: its
  wall time and final metrics (all_results.json).

Every timed p-LaT row counts the backends ``auto`` chose, by name (under torch.compile: the choices made while
tracing, once per graph), so that a fall back from the fused kernels shows. The targets are judged at the end,
one PASS / FAIL / NOT MEASURED line each (TARGETS). Sections run in order while the time used plus the
section's expected time (EXPECTED_S, estimated for an H100) fits --budget-s; one that would not is skipped with
the reason. The record is rewritten after every section, so that a run stopped from outside keeps what was
done, with the GPU, driver, CUDA, torch, Triton and transformers versions and the folder modeling_plat was imported
from (a baseline's on PYTHONPATH is measured the same way). Exit status: 1 if anything failed
(a check, a target, an error), 2 without a CUDA GPU.
"""

import argparse
import collections
import cProfile
import contextlib
import datetime
import functools
import importlib
import itertools
import json
import multiprocessing
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

import modeling_plat
from modeling_plat import paper_p_mix
from modeling_plat.plap_dispatch import choose_backend, plap_attention

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("sweep", "attention", "envelope", "kernels", "train", "compile", "fallback", "decode", "main-job")
# Seconds each section is expected to take on an H100 or H200 (kernel builds and Inductor compiles dominate; attention,
# kernels and train as measured on an H200, 2026-11-27), which the budget guard adds to the time used before starting
# it; the sweep stops waiting for its cases when the budget runs out.
EXPECTED_S = {"sweep": 150, "attention": 90, "envelope": 40, "kernels": 20, "train": 30, "compile": 180, "fallback": 40,
              "decode": 40, "main-job": 90}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DIMS = (16, 48, 64, 80, 128)
FEW_HEAD_DIMS = (16, 64, 128)
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
# float32 matmuls with inputs rounded to TF32 (2^-11 relative): 1.2e-4 to 7.1e-4 measured on an H100.
TF32_TOLERANCE = 2e-3
# (B, H, Nq, Nk) of the sweep: lengths that are not multiples of any tile.
SQUARE, KV_CACHE = (2, 3, 200, 200), (2, 3, 77, 200)
P_PER_HEAD = (1.5, 2.5, 3.0)
# Positions whose values copy position 4's: a run inside the first tile, single copies in later ones.
REPEATS = (*range(5, 20), 70, 150, 199)
# Document lengths of the two packed rows of SQUARE: no tile multiples, a one-token document, a long one.
PACKED_LENGTHS = ((37, 1, 100, 62), (64, 64, 72))
CONVERSIONS = ("gpt2", "llama", "vit")

# name: (batch, heads, length, head size, causal)
ATTENTION_SHAPES = {
    "paper-lm": (16, 8, 256, 16, True),
    "deit-tiny": (64, 3, 197, 64, False),
    "1k": (8, 12, 1024, 64, True),
    "4k": (2, 16, 4096, 64, True),
    "4k-d128": (2, 16, 4096, 128, True),
    "16k": (1, 8, 16384, 64, True),
}
# The kernel-speed targets against SDPA's default backend: (shape, fwd or fwd_bwd, limit), and peak memory.
KERNEL_SPEED_TARGETS = [("4k", "fwd", 2.0), ("4k", "fwd_bwd", 2.5), ("4k-d128", "fwd_bwd", 3.0), ("16k", "fwd_bwd", 2.5)]
KERNEL_SPEED_SHAPES = tuple(dict.fromkeys(name for name, _, _ in KERNEL_SPEED_TARGETS))
PEAK_MEMORY_LIMIT = 1.2
# Functions a kernels row's host profile keeps, by own time.
HOST_PROFILE_TOP = 30
# name: (shape, p per head: None for the paper's mix) of the kernels section.
KERNEL_CASES = {
    **{name: (ATTENTION_SHAPES[name], None) for name in ("paper-lm", *KERNEL_SPEED_SHAPES)},
    "4k-p1.5": (ATTENTION_SHAPES["4k"], 1.5),
}
# label: the SDPBackend scaled_dot_product_attention is restricted to (None: its own choice).
SDPA_VARIANTS = {"sdpa": None, "sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
# Multiply-adds of the matmuls per score and head-size unit: forward, forward + backward.
MATMUL_FLOOR = {"plat": (3, 11), "sdpa": (2, 7)}

TRAIN_BATCHES = {"vision": 64, "lm": 16, "llama-125m": 8}
COMPILE_PRESETS = ("plat-ptb-tiny", "plat-llama-tiny")
# plap_attention compiled against eager, bfloat16, the paper's p mix, each formulation: the paper LM's shape (each
# kernel's exact pass alone) and a causal 2k (first passes, then exact passes).
COMPILED_ATTENTION_SHAPES = {"paper-lm": ATTENTION_SHAPES["paper-lm"], "2k": (2, 4, 2048, 64, True)}
CUDA_GRAPHS_PRESET = "plat-ptb-tiny"
# What auto should run on CUDA: the fused kernels, and the decode path for a few queries.
FUSED = {"triton", "decode"}


def error_fields(error):
    """The fields of a row that raised ``error``: its message (also as the row's failure) and the traceback."""
    message = f"{type(error).__name__}: {error}"
    return dict(error=message, trace=traceback.format_exc(), failures=[message])


@contextlib.contextmanager
def backend_spy():
    """A Counter of the backends plap_attention's dispatcher returns while inside, by name. Eager code counts every
    call; torch.compile counts while tracing, once per graph: the count is a constant of the trace, so that it
    neither breaks the graph nor adds a guard."""
    module = importlib.import_module("modeling_plat.plap_dispatch")
    original, chosen = module.choose_backend, collections.Counter()

    @torch.compiler.assume_constant_result
    def count(name):
        chosen[name] += 1
        return True

    def spy(*args, **kwargs):
        backend = original(*args, **kwargs)
        count(backend.name)
        return backend

    module.choose_backend = spy
    try:
        yield chosen
    finally:
        module.choose_backend = original


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, warmup, repeats, device):
    """Median seconds of fn(): CUDA events around each call on a GPU, the host clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_memory_mib(fn, device):
    """MiB that one fn() allocates on the GPU at its peak beyond what was allocated before; None elsewhere."""
    if device.type != "cuda":
        return None
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def to_device(batch, device):
    return {name: tensor.to(device) for name, tensor in batch.items()}


# ---------------------------------------------------------------------------------------------------- sweep


def sweep_cases():
    """Every case of the correctness sweep, as JSON-ready dicts."""
    cases = []
    # Dtype and head size vary fastest: side by side, the workers build different kernels.
    for backend, shape, masked, formulation, head_dim, dtype in itertools.product(
        ("triton", "auto"), (SQUARE, KV_CACHE), (False, True), ("paper", "euler"), HEAD_DIMS, DTYPES
    ):
        cases.append(dict(kind="backend", backend=backend, dtype=dtype, head_dim=head_dim,
                          formulation=formulation, masked=masked, shape=shape))  # fmt: skip
    # The sweep's small calls run each kernel's exact pass alone (ONE_PASS_PAIRS); large ones a first pass, then the
    # exact pass of the flagged blocks: the same cases with both passes, the power's three classes among the heads.
    for shape, masked, formulation, head_dim, dtype in itertools.product(
        (SQUARE, KV_CACHE), (False, True), ("paper", "euler"), HEAD_DIMS, DTYPES
    ):
        cases.append(dict(kind="backend", backend="triton", dtype=dtype, head_dim=head_dim, formulation=formulation,
                          masked=masked, shape=shape, two_passes=True))  # fmt: skip
    for backend, formulation in itertools.product(("eager", "tiled"), ("paper", "euler")):
        cases.append(dict(kind="tf32", backend=backend, dtype="float32", head_dim=64, formulation=formulation,
                          masked=True, shape=SQUARE))  # fmt: skip
    # masked: causal + key padding for repeated values; causal for packed rows (their documents are the mask).
    for kind, backend, masked, formulation, head_dim, dtype in itertools.product(
        ("repeated", "packed"), ("triton", "auto"), (False, True), ("paper", "euler"), FEW_HEAD_DIMS, DTYPES
    ):
        cases.append(dict(kind=kind, backend=backend, dtype=dtype, head_dim=head_dim, formulation=formulation,
                          masked=masked, shape=SQUARE))  # fmt: skip
        if backend == "triton":
            cases.append(dict(cases[-1], two_passes=True))
    for model, dtype in itertools.product(CONVERSIONS, ("float32", "bfloat16")):
        cases.append(dict(kind="convert", model=model, dtype=dtype))
    return cases


def case_name(case):
    if case["kind"] == "convert":
        return f"convert/{case['model']}/{case['dtype']}"
    batch, heads, nq, nk = case["shape"]
    mask = ("causal" if case["kind"] == "packed" else "causal+padding") if case["masked"] else "nomask"
    passes = "/two-passes" if case.get("two_passes") else ""
    return (f"{case['kind']}/{case['backend']}/{case['dtype']}/d{case['head_dim']}/{case['formulation']}/{mask}/"
            f"nq{nq}-nk{nk}{passes}")  # fmt: skip


def document_ids(device):
    return torch.tensor([[doc for doc, n in enumerate(row) for _ in range(n)] for row in PACKED_LENGTHS], device=device)


def make_case_inputs(case, device):
    """(q, k, v) leaves in the case's dtype, p, the mask arguments and the output gradient."""
    batch, heads, nq, nk = case["shape"]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, nq, case["head_dim"], generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, nk, case["head_dim"], generator=gen, dtype=torch.float64) for _ in range(2))
    if case["kind"] in ("tf32", "repeated"):
        # Repeated tokens: exact duplicates in any dtype, D2 = 0 off the diagonal.
        v[:, :, [position for position in REPEATS if position < nk]] = v[:, :, 4:5]
    dtype = DTYPES[case["dtype"]]
    inputs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    p = tuple(P_PER_HEAD[h % len(P_PER_HEAD)] for h in range(heads))  # static, as models pass it: no host read
    kwargs = dict(formulation=case["formulation"])
    if case["kind"] == "packed":
        kwargs.update(is_causal=case["masked"], document_ids=document_ids(device))
    elif case["masked"]:
        keep = torch.ones(batch, nk, dtype=torch.bool)
        keep[0, :7] = False  # left padding
        keep[-1, :] = False  # a sequence with every key masked
        kwargs.update(is_causal=True, attn_mask=keep[:, None, None, :].to(device))
    grad_out = torch.randn(batch, heads, nq, case["head_dim"], generator=gen, dtype=torch.float64).to(device)
    return inputs, p, kwargs, grad_out


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def attend(inputs, p, kwargs, backend):
    return plap_attention(*inputs, p, **kwargs, backend=backend)


def each_document_alone(inputs, p, kwargs, backend):
    """What packed rows must give: every document attended alone, without document_ids, put back in place."""
    alone = {name: value for name, value in kwargs.items() if name != "document_ids"}
    rows = []
    for row, lengths in enumerate(PACKED_LENGTHS):
        starts = itertools.accumulate(lengths, initial=0)
        rows.append(torch.cat([attend([t[row : row + 1, :, start : start + n] for t in inputs], p, alone, backend)
                               for start, n in zip(starts, lengths)], dim=2))  # fmt: skip
    return torch.cat(rows)


def outputs_and_gradients(inputs, p, kwargs, grad_out, backend, run=attend):
    out = run(inputs, p, kwargs, backend)
    return (out, *torch.autograd.grad(out, inputs, grad_out.to(out.dtype)))


def conversion_models(name):
    """A tiny random transformers model of a CONVERSIONS name, its p = 2 conversion and example inputs."""
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ViTConfig,
                              ViTForImageClassification)  # fmt: skip

    from modeling_plat.convert import convert_to_plat

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "vit":
        source = ViTForImageClassification(ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=128, image_size=32, patch_size=4,
                                                     num_labels=10))  # fmt: skip
        inputs = dict(pixel_values=torch.randn(2, 3, 32, 32, generator=gen))
    else:
        if name == "gpt2":
            source = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64,
                                                bos_token_id=0, eos_token_id=0))  # fmt: skip
        else:
            source = LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=64))  # fmt: skip
        inputs = dict(input_ids=torch.randint(0, 101, (2, 48), generator=gen))
    return source.eval(), convert_to_plat(source, plap_p=2.0).eval(), inputs


def run_conversion(case, device):
    source, plat, inputs = conversion_models(case["model"])
    dtype = DTYPES[case["dtype"]]
    source, plat = source.to(device, dtype), plat.to(device, dtype)
    inputs = {name: t.to(device, dtype) if t.is_floating_point() else t.to(device) for name, t in inputs.items()}
    with torch.no_grad():
        expected = source(**inputs).logits
        first, second = (plat(**inputs).logits for _ in range(2))
    return dict(status="ok", errors=dict(logits=relative_error(first, expected)),
                max_abs_diff=(first.double() - expected.double()).abs().max().item(),
                max_abs_logit=expected.abs().max().item(), finite=bool(torch.isfinite(first).all()),
                bitwise_rerun=torch.equal(first, second))  # fmt: skip


@contextlib.contextmanager
def one_pass_pairs(limit):
    """The Triton backend's ONE_PASS_PAIRS set to ``limit`` (None: left as it is)."""
    triton_module = importlib.import_module("modeling_plat.plap_attention_triton")
    original = triton_module.ONE_PASS_PAIRS
    triton_module.ONE_PASS_PAIRS = original if limit is None else limit
    try:
        yield
    finally:
        triton_module.ONE_PASS_PAIRS = original


def run_case(case, device):
    """Result of one sweep case: the backend that ran, relative errors and the rerun check, or a skip."""
    device = torch.device(device)
    if case["kind"] == "convert":
        return run_conversion(case, device)
    inputs, p, kwargs, grad_out = make_case_inputs(case, device)
    try:
        backend = choose_backend(case["backend"], *inputs, p=p, attn_mask=kwargs.get("attn_mask"),
                                 document_ids=kwargs.get("document_ids"), formulation=case["formulation"]).name
    except ValueError as reason:
        return dict(status="skipped", reason=str(reason))
    reference_inputs = [t.detach().double().requires_grad_() for t in inputs]
    reference_run = each_document_alone if case["kind"] == "packed" else attend
    reference = outputs_and_gradients(reference_inputs, p, kwargs, grad_out, "eager", reference_run)

    def errors(results):
        return {name: relative_error(ours, ref)
                for name, ours, ref in zip(("out", "dq", "dk", "dv"), results, reference)}

    with tf32_matmuls(case["kind"] == "tf32"), one_pass_pairs(0 if case.get("two_passes") else None):
        first = outputs_and_gradients(inputs, p, kwargs, grad_out, case["backend"])
        second = outputs_and_gradients(inputs, p, kwargs, grad_out, case["backend"])
    result = dict(status="ok", backend=backend, errors=errors(first),
                  finite=all(bool(torch.isfinite(t).all()) for t in first),
                  bitwise_rerun=all(torch.equal(a, b) for a, b in zip(first, second)))  # fmt: skip
    if case["kind"] == "tf32":
        result["errors_without_tf32"] = errors(outputs_and_gradients(inputs, p, kwargs, grad_out, case["backend"]))
    return result


@contextlib.contextmanager
def tf32_matmuls(enabled):
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def judge(case, result):
    """The list of reasons this case failed (empty if it passed)."""
    if result["status"] == "error":
        return [result["error"]]
    if result["status"] == "skipped":
        return []
    problems = []
    for name, error in result["errors"].items():
        floor = TF32_TOLERANCE if case["kind"] == "tf32" else TOLERANCE[case["dtype"]]
        limit = max(floor, 2 * result.get("errors_without_tf32", {}).get(name, 0))
        if not error <= limit:
            problems.append(f"{name} error {error:.2e} > {limit:.1e}")
    if not result["finite"]:
        problems.append("non-finite values")
    if not result["bitwise_rerun"]:
        problems.append("a second run differs")
    return problems


def run_sweep(cases, runner, log=print, workers=0, seconds=None):
    """Run every case with runner(case) -> result dict, an exception becoming an "error" result; with workers, in
    that many spawned processes (runner must pickle), so that a crashed kernel cannot take this process along. Cases
    whose result is not in within ``seconds`` (None: no limit) are "skipped" for the time budget, and not waited for."""
    deadline = None if seconds is None else time.monotonic() + seconds
    with contextlib.ExitStack() as stack:
        if workers:
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            stack.callback(_stop, pool, wait=deadline is None)
            futures = [pool.submit(runner, case) for case in cases]
            calls = [functools.partial(_result_by, future, deadline) for future in futures]
        else:
            calls = [functools.partial(_run_by, runner, case, deadline) for case in cases]
        results = []
        for case, call in zip(cases, calls):
            try:
                result = call()
            except TimeoutError:
                result = dict(status="skipped", reason="the time budget ran out before its result")
            except Exception as error:  # a crash is a failed check, reported with the rest
                result = dict(status="error", error=f"{type(error).__name__}: {error}", trace=traceback.format_exc())
            result.update(case=case_name(case), failures=judge(case, result))
            log(f"{result['case']:<60} {result['status']:<8} {result.get('backend', '')} "
                f"{'; '.join(result['failures'])}")  # fmt: skip
            results.append(result)
    return results


def _stop(pool, wait):
    """Shut the pool down; without waiting, its running cases are killed too, or the interpreter's exit would wait for
    them (minutes of a lease, for a compilation that no one reads)."""
    processes = list(pool._processes.values()) if not wait else []
    pool.shutdown(wait=wait, cancel_futures=True)
    for process in processes:
        process.kill()


def _result_by(future, deadline):
    return future.result(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))


def _run_by(runner, case, deadline):
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError
    return runner(case)


def sweep_section(device, log, workers=0, cases=None, seconds=None):
    return run_sweep(sweep_cases() if cases is None else cases, functools.partial(run_case, device=str(device)),
                     log, workers, seconds)  # fmt: skip


# ------------------------------------------------------------------------------------------------ attention


def sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attention_timings(call, inputs, grad_out, work, floor, device, warmup, repeats):
    """Forward and forward + backward milliseconds of call(), TFLOP/s against ``floor`` multiply-adds per unit of
    ``work``, and the peak memory of a forward + backward."""

    def forward_backward():
        torch.autograd.grad(call(), inputs, grad_out)

    with torch.no_grad():
        forward = timed(call, warmup, repeats, device)
    both = timed(forward_backward, warmup, repeats, device)
    return dict(fwd_ms=forward * 1e3, fwd_bwd_ms=both * 1e3, fwd_tflops=2 * floor[0] * work / forward / 1e12,
                fwd_bwd_tflops=2 * floor[1] * work / both / 1e12,
                fwd_bwd_peak_mib=peak_memory_mib(forward_backward, device))  # fmt: skip


def bf16_attention_inputs(batch, heads, length, head_dim, device):
    """Seeded bfloat16 q, k, v (requiring grad) and dU of one attention shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))  # fmt: skip
    return q, k, v, torch.randn(q.shape, generator=gen, device=device, dtype=torch.bfloat16)


def attention_row(name, shape, device, warmup, repeats):
    batch, heads, length, head_dim, causal = shape
    q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
    p = tuple(paper_p_mix(heads))
    work = batch * heads * length * length * (0.5 if causal else 1.0) * head_dim
    row = dict(name=name, batch=batch, heads=heads, length=length, head_dim=head_dim, causal=causal)
    measure = functools.partial(attention_timings, inputs=(q, k, v), grad_out=grad_out, work=work, device=device,
                                warmup=warmup, repeats=repeats)  # fmt: skip
    try:
        with backend_spy() as chosen:
            row["plat"] = measure(lambda: plap_attention(q, k, v, p, is_causal=causal), floor=MATMUL_FLOOR["plat"])
        row["plat"]["backends"] = dict(chosen)
    except Exception as error:
        row.update(error_fields(error))
    for label, backend in SDPA_VARIANTS.items():
        try:
            row[label] = measure(functools.partial(sdpa, q, k, v, causal, backend), floor=MATMUL_FLOOR["sdpa"])
        except Exception as error:  # a baseline this GPU or shape does not offer: recorded, no failure of ours
            row[label] = dict(unavailable=f"{type(error).__name__}: {error}")
        if "fwd_ms" in row.get("plat", {}) and "fwd_ms" in row[label]:
            row[f"ratio_to_{label}"] = dict(fwd=row["plat"]["fwd_ms"] / row[label]["fwd_ms"],
                                            fwd_bwd=row["plat"]["fwd_bwd_ms"] / row[label]["fwd_bwd_ms"])  # fmt: skip
    return row


def attention_section(device, log, shapes=ATTENTION_SHAPES, warmup=3, repeats=10):
    rows = []
    for name, shape in shapes.items():
        rows.append(attention_row(name, shape, device, warmup, repeats))
        ratios = {label: round(rows[-1][f"ratio_to_{label}"]["fwd_bwd"], 2)
                  for label in SDPA_VARIANTS if f"ratio_to_{label}" in rows[-1]}  # fmt: skip
        log(f"attention {name}: plat fwd+bwd / {ratios} {rows[-1].get('error', '')}")
    return rows


# ------------------------------------------------------------------------------------------------- envelope

# name: (batch, heads, length, head size, what the inputs add): the inputs that reached the fused kernels last
ENVELOPE_SHAPES = {
    "window-4096-16k": (1, 8, 16384, 64, dict(sliding_window=4096)),  # Mistral's window over 16k tokens
    "d256-4k": (2, 8, 4096, 256, {}),  # Gemma 2/3's head size
    "packed-4k": (1, 16, 4096, 64, dict(documents=(1000, 24, 1500, 800, 772))),  # padding-free training
    # Llama 4's chunked layers: plap_mask makes each chunk a document of the kernels
    "chunks-8192-16k": (1, 8, 16384, 64, dict(documents=(8192, 8192))),
}
ENVELOPE_LIMIT = 3.0  # forward + backward against SDPA given the same pattern


def flash_window(q, k, v, window):
    """FlashAttention-2's own sliding window (the flash_attn package), where installed."""
    from flash_attn import flash_attn_func

    # (B, N, H, d); keys in [x - (window - 1), x].
    out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, window_size=(window - 1, 0))
    return out.transpose(1, 2)


def envelope_row(name, shape, device, warmup, repeats):
    """p-LaT (auto) against SDPA given the same pattern as a boolean mask (its default backend chooses), and
    FlashAttention-2's window where installed; forward + backward, peak memory, the backends auto chose."""
    from modeling_plat.plap_attention_reference import allowed_positions, sliding_window_positions

    batch, heads, length, head_dim, extra = shape
    q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
    p = tuple(paper_p_mix(heads))
    kwargs, mask, baselines = dict(is_causal=True), None, {}
    if "sliding_window" in extra:
        kwargs["sliding_window"] = extra["sliding_window"]
        mask = sliding_window_positions(length, length, extra["sliding_window"], device)
        baselines["flash-window"] = functools.partial(flash_window, q, k, v, extra["sliding_window"])
    if "documents" in extra:
        ids = torch.repeat_interleave(torch.arange(len(extra["documents"]), device=device),
                                      torch.tensor(extra["documents"], device=device))[None].expand(batch, -1)
        kwargs["document_ids"] = ids
        mask = allowed_positions(None, True, length, length, device, ids)
    pairs = int(mask.expand(batch, 1, length, length).sum()) if mask is not None else batch * length * (length + 1) // 2
    work = pairs * heads * head_dim
    row = dict(name=name, batch=batch, heads=heads, length=length, head_dim=head_dim,
               pattern={key: value for key, value in extra.items()})  # fmt: skip
    measure = functools.partial(attention_timings, inputs=(q, k, v), grad_out=grad_out, work=work, device=device,
                                warmup=warmup, repeats=repeats)  # fmt: skip
    try:
        with backend_spy() as chosen:
            row["plat"] = measure(lambda: plap_attention(q, k, v, p, **kwargs), floor=MATMUL_FLOOR["plat"])
        row["plat"]["backends"] = dict(chosen)
    except Exception as error:
        row.update(error_fields(error))

    def sdpa_pattern():
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    for label, call in {"sdpa": sdpa_pattern, **baselines}.items():
        try:
            row[label] = measure(call, floor=MATMUL_FLOOR["sdpa"])
            row[f"ratio_to_{label}"] = dict(fwd=row["plat"]["fwd_ms"] / row[label]["fwd_ms"],
                                            fwd_bwd=row["plat"]["fwd_bwd_ms"] / row[label]["fwd_bwd_ms"])  # fmt: skip
        except Exception as error:  # a baseline not installed, or a failed row of ours: recorded above
            row[label] = dict(unavailable=f"{type(error).__name__}: {error}")
    return row


def envelope_section(device, log, shapes=ENVELOPE_SHAPES, warmup=3, repeats=10):
    rows = []
    for name, shape in shapes.items():
        rows.append(envelope_row(name, shape, device, warmup, repeats))
        ratio = rows[-1].get("ratio_to_sdpa", {}).get("fwd_bwd")
        log(f"envelope {name}: plat fwd+bwd / sdpa {ratio} {rows[-1].get('plat', {}).get('backends')} "
            f"{rows[-1].get('error', '')}")
    return rows


# ------------------------------------------------------------------------------------------------- fallback

# Inputs the fused kernels refuse (a (B, H, N, N) mask, p that trains): eager against tiled on CUDA, bfloat16.
FALLBACK_SHAPES = {"512": (4, 8, 512, 64), "2k": (2, 8, 2048, 64), "8k": (1, 8, 8192, 64)}


def fallback_section(device, log, shapes=FALLBACK_SHAPES, warmup=2, repeats=5):
    """Forward + backward time and peak memory of the eager and tiled backends where the kernels cannot run: what
    ``auto`` should take on CUDA for them."""
    rows = []
    for name, (batch, heads, length, head_dim) in shapes.items():
        q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
        mask = torch.rand(batch, heads, length, length, device=device) > 0.1  # a full mask: no kernel takes it
        p = tuple(paper_p_mix(heads))
        row = dict(name=name, batch=batch, heads=heads, length=length, head_dim=head_dim)
        for backend in ("eager", "tiled"):
            try:
                row[backend] = attention_timings(lambda: plap_attention(q, k, v, p, attn_mask=mask, backend=backend),
                                                 (q, k, v), grad_out, 1, MATMUL_FLOOR["plat"], device, warmup,
                                                 repeats)  # fmt: skip
            except Exception as error:  # out of memory, most likely: recorded, not a failure of the check
                row[backend] = dict(unavailable=f"{type(error).__name__}: {str(error)[:300]}")
        times = {b: row[b]["fwd_bwd_ms"] for b in ("eager", "tiled") if "fwd_bwd_ms" in row[b]}
        row["faster"] = min(times, key=times.get) if times else None
        log(f"fallback {name}: fwd+bwd ms {times}, peak MiB "
            f"{ {b: row[b].get('fwd_bwd_peak_mib') for b in ('eager', 'tiled')} }")
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------- kernels


def kernel_times(call, device, repeats):
    """{name: launches per call, microseconds per call, median microseconds of each launch in launch order} of the
    kernels that call() runs on ``device``, from torch.profiler (on a CPU: its operators, nested ones included)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()  # builds and caches what the first call compiles
    synchronize(device)
    activity, kind = (ProfilerActivity.CUDA, DeviceType.CUDA) if device.type == "cuda" else (ProfilerActivity.CPU,
                                                                                            DeviceType.CPU)
    with profile(activities=[activity]) as prof:
        for _ in range(repeats):
            call()
        synchronize(device)
    durations = collections.defaultdict(list)
    for event in sorted(prof.events(), key=lambda event: event.time_range.start):
        if event.device_type == kind:
            durations[event.name].append(event.time_range.elapsed_us())
    kernels = {}
    for name, times in durations.items():
        launches = len(times) // repeats
        if launches * repeats != len(times):  # not launched the same number of times by every call
            raise RuntimeError(f"{name} ran {len(times)} times in {repeats} calls")
        kernels[name] = dict(launches=launches, us=sum(times) / repeats,
                             launch_us=[statistics.median(times[i::launches]) for i in range(launches)])  # fmt: skip
    return kernels


def host_times(call, device, repeats):
    """Host microseconds of one call() (median; the GPU idle at its start, as the timed rows' calls find it) and of
    the Triton launches in it (the backend's ``_run``, each kernel's argument handling and launch)."""
    triton_module = importlib.import_module("modeling_plat.plap_attention_triton")
    original, launches = triton_module._run, []

    def timed_run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            launches[-1].append(time.perf_counter() - start)

    triton_module._run = timed_run
    calls = []
    try:
        for _ in range(repeats):
            synchronize(device)
            launches.append([])
            start = time.perf_counter()
            call()
            calls.append(time.perf_counter() - start)
    finally:
        triton_module._run = original
    synchronize(device)
    return dict(call_us=statistics.median(calls) * 1e6, launches=len(launches[-1]),
                launch_us=statistics.median(sum(times) for times in launches) * 1e6)  # fmt: skip


def host_profile(call, device, repeats, top=HOST_PROFILE_TOP):
    """Where one call() spends its host time: cProfile over ``repeats`` calls (the GPU idle at each start), the
    ``top`` functions by own time (builtins such as a tensor allocation or a kernel's launcher included), in
    microseconds per call, own and cumulative, with their calls per call, and ``own_us``, the own times of every
    function summed. The profiler adds its own cost to every function call: the shares tell, not the absolute times.
    From Python 3.12 on cProfile also sees the backward's Python, which the autograd engine runs in a thread of its
    own for CUDA tensors; before, that time is the own time of the engine's ``run_backward``."""
    profiler = cProfile.Profile()
    for _ in range(repeats):
        synchronize(device)
        profiler.enable()
        try:
            call()
        finally:
            profiler.disable()
    synchronize(device)
    # pstats' table: (file, line, function) -> (primitive calls, calls, own seconds, cumulative seconds, callers).
    table = pstats.Stats(profiler).stats
    functions = [dict(function=_function_label(*where), calls=calls / repeats, own_us=own / repeats * 1e6,
                      cumulative_us=cumulative / repeats * 1e6)
                 for where, (_, calls, own, cumulative, _) in table.items()]  # fmt: skip
    functions.sort(key=lambda function: -function["own_us"])
    return dict(own_us=sum(function["own_us"] for function in functions), python=platform.python_version(),
                functions=functions[:top])  # fmt: skip


def _function_label(file, line, name):
    """``path:line(name)`` with the path from the package folder on (``site-packages/`` or this repository cut), or
    the builtin's own name."""
    if file == "~":
        return name
    parts = Path(file).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            parts = parts[len(parts) - parts[::-1].index(anchor) :]
            break
    else:
        if Path(file).is_relative_to(ROOT):
            parts = Path(file).relative_to(ROOT).parts
    return f"{Path(*parts).as_posix()}:{line}({name})"


def kernels_section(device, log, cases=KERNEL_CASES, repeats=5):
    rows = []
    for name, ((batch, heads, length, head_dim, causal), p) in cases.items():
        q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
        p_heads = tuple(paper_p_mix(heads)) if p is None else (p,) * heads
        row = dict(name=name, batch=batch, heads=heads, length=length, head_dim=head_dim, causal=causal,
                   p=sorted(set(p_heads)))  # fmt: skip

        def call():
            torch.autograd.grad(plap_attention(q, k, v, p_heads, is_causal=causal), (q, k, v), grad_out)

        try:
            # Host times before the profiler session: measured after it (6d6cd30's record), a paper-LM call's host
            # work read 1.73 ms where the attention section's whole synchronised call took 1.33.
            with backend_spy() as chosen:
                row["host"] = host_times(call, device, repeats)
                row["host_profile"] = host_profile(call, device, repeats)
                row["kernels"] = kernel_times(call, device, repeats)
            row["backends"] = dict(chosen)
            row["total_us"] = sum(kernel["us"] for kernel in row["kernels"].values())
            top = sorted(row["kernels"].items(), key=lambda item: -item[1]["us"])[:4]
            log(f"kernels {name}: {row['total_us']:.0f} us, " + ", ".join(f"{kernel} {times['us']:.0f}"
                                                                          for kernel, times in top)
                + f"; host {row['host']['call_us']:.0f} us, {row['host']['launch_us']:.0f} in "
                  f"{row['host']['launches']} Triton launches; most own host time (profiled): "
                + ", ".join(f"{function['function']} {function['own_us']:.0f} us"
                            for function in row["host_profile"]["functions"][:3]))  # fmt: skip
        except Exception as error:
            row.update(error_fields(error))
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------------------- training steps


def training_step(model, optimizer, inputs, device, cuda_graphs=False):
    """One optimizer step under bf16 autocast, as a closure."""

    def step():
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs (loss, grads) are consumed
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def step_timings(model, inputs, device, warmup, repeats):
    model.to(device).train()
    step = training_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), inputs, device)
    with backend_spy() as chosen:
        seconds = timed(step, warmup, repeats, device)
        peak = peak_memory_mib(step, device)
    return dict(step_ms=seconds * 1e3, peak_mib=peak, backends=dict(chosen))


def train_pair(pair, batch_size, device, warmup, repeats, log):
    """Rows of one bench_train_step pair, the last model (transformers' twin) the baseline of each ratio."""
    from bench_train_step import PAIRS, batches

    models = PAIRS[pair][0]("auto")
    inputs = to_device(batches(pair, batch_size), device)
    rows = []
    for name, model in models.items():
        row = dict(name=name, pair=pair, batch=batch_size, parameters=sum(p.numel() for p in model.parameters()))
        try:
            row.update(step_timings(model, inputs, device, warmup, repeats))
        except Exception as error:
            row.update(error_fields(error))
        model.cpu()
        log(f"train {name}: {row.get('step_ms', row.get('error'))} ms, backends {row.get('backends')}")
        rows.append(row)
    baseline = rows[-1]
    for row in rows:
        if "step_ms" in row and "step_ms" in baseline:
            row.update(baseline=baseline["name"], ratio=row["step_ms"] / baseline["step_ms"])
    return rows


def train_section(device, log, batches=TRAIN_BATCHES, warmup=3, repeats=10):
    rows = []
    for pair, batch_size in batches.items():
        try:
            rows.extend(train_pair(pair, batch_size, device, warmup, repeats, log))
        except Exception as error:
            rows.append(dict(name=pair, pair=pair, **error_fields(error)))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------- torch.compile


def dynamo_counts():
    from torch._dynamo.utils import counters

    return dict(graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))


def fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def first_call_and_steps(step, device, warmup, repeats):
    """Seconds of step()'s first call (the compile) and the median step after warm-up."""
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start, timed(step, warmup, repeats, device)


def compiled_step_row(preset, compiled, eager, inputs, device, warmup, repeats):
    row = dict(name=f"{preset}/train-step", kind="train-step", preset=preset)
    row.update(eager=step_timings(eager, inputs, device, warmup, repeats))
    fresh_dynamo()
    compiled.to(device).train()
    step = training_step(compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-4), inputs, device)
    with backend_spy() as chosen:
        first_s, seconds = first_call_and_steps(step, device, warmup, repeats)
    row.update(first_call_s=first_s, step_ms=seconds * 1e3, ratio_to_eager=seconds * 1e3 / row["eager"]["step_ms"],
               backends=dict(chosen), **dynamo_counts())  # fmt: skip
    return row


def cuda_graphs_row(preset, eager, inputs, device, warmup, repeats):
    row = dict(name=f"{preset}/train-step-cuda-graphs", kind="train-step-cuda-graphs", preset=preset)
    fresh_dynamo()
    graphed = torch.compile(eager, fullgraph=True, mode="reduce-overhead")
    step = training_step(graphed, torch.optim.AdamW(eager.parameters(), lr=1e-4), inputs, device, cuda_graphs=True)
    with backend_spy() as chosen:
        first_s, seconds = first_call_and_steps(step, device, warmup, repeats)
    row.update(first_call_s=first_s, step_ms=seconds * 1e3, backends=dict(chosen), **dynamo_counts())
    return row


def compiled_generation_row(preset, model, device, compiler, new_tokens):
    """Greedy decoding with model.forward compiled (fullgraph) against eager decoding."""
    model.to(device).eval()
    prompt = torch.randint(2, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0)).to(device)
    generate = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        expected = model.generate(prompt, **generate)
        fresh_dynamo()
        model.forward = torch.compile(model.forward, backend=compiler, fullgraph=True)
        try:
            with backend_spy() as chosen:
                start = time.perf_counter()
                tokens = model.generate(prompt, **generate)
                seconds = time.perf_counter() - start
        finally:
            del model.forward  # the class's forward again
    return dict(name=f"{preset}/generate", kind="generate", preset=preset, new_tokens=new_tokens, seconds=seconds,
                tokens_equal_eager=torch.equal(tokens, expected), backends=dict(chosen), **dynamo_counts())  # fmt: skip


def compiled_attention_row(name, shape, formulation, device, compiler):
    """plap_attention's output and the gradients of q, k and v, compiled (fullgraph) against eager on the same inputs:
    on a GPU the fused kernels as Inductor launches them, with their arguments functionalized (each tensor a kernel
    writes is cloned and copied back), which an argument that aliased a written one would break."""
    batch, heads, length, head_dim, causal = shape
    q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
    p = tuple(paper_p_mix(heads))
    row = dict(name=f"{name}/attention-{formulation}", kind="attention", formulation=formulation, batch=batch,
               heads=heads, length=length, head_dim=head_dim, causal=causal)  # fmt: skip

    def attend(q, k, v):
        return plap_attention(q, k, v, p, is_causal=causal, formulation=formulation)

    def forward_backward(attend):
        out = attend(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

    expected = forward_backward(attend)
    fresh_dynamo()
    with backend_spy() as chosen:
        compiled = forward_backward(torch.compile(attend, backend=compiler, fullgraph=True))
    errors = {part: relative_error(ours, reference)
              for part, ours, reference in zip(("out", "grad_q", "grad_k", "grad_v"), compiled, expected)}  # fmt: skip
    tolerance = TOLERANCE["bfloat16"]
    row.update(errors=errors, tolerance=tolerance, backends=dict(chosen), **dynamo_counts())
    row["failures"] = [f"{part}: relative error {error:.2e} > {tolerance}" for part, error in errors.items()
                       if not error <= tolerance]  # fmt: skip
    return row


def compile_section(device, log, presets=COMPILE_PRESETS, cuda_graphs_preset=CUDA_GRAPHS_PRESET, compiler="inductor",
                    batch=32, warmup=3, repeats=10, new_tokens=12, attention_shapes=COMPILED_ATTENTION_SHAPES):  # fmt: skip
    from bench_train_step import batches, compile_pair

    inputs = to_device(batches("compile", batch), device)
    rows = []
    for (name, shape), formulation in itertools.product(attention_shapes.items(), ("paper", "euler")):
        try:
            rows.append(compiled_attention_row(name, shape, formulation, device, compiler))
        except Exception as error:
            rows.append(dict(name=f"{name}/attention-{formulation}", kind="attention", **error_fields(error)))
        log(f"compile {rows[-1]['name']}: " + json.dumps({key: rows[-1].get(key) for key in (
            "errors", "backends", "graph_breaks", "error")}))
    for preset in presets:
        try:
            compiled, eager = compile_pair(preset, backend=compiler)("auto").values()
        except Exception as error:
            rows.append(dict(name=preset, preset=preset, **error_fields(error)))
            continue
        runs = [functools.partial(compiled_step_row, preset, compiled, eager, inputs, device, warmup, repeats)]
        if preset == cuda_graphs_preset:
            runs.append(functools.partial(cuda_graphs_row, preset, eager, inputs, device, warmup, repeats))
        runs.append(functools.partial(compiled_generation_row, preset, eager, device, compiler, new_tokens))
        for run in runs:
            if run.func is cuda_graphs_row and device.type != "cuda":
                rows.append(dict(name=f"{preset}/train-step-cuda-graphs", kind="train-step-cuda-graphs",
                                 preset=preset, skipped="CUDA graphs need a CUDA device"))  # fmt: skip
                continue
            try:
                rows.append(run())
            except Exception as error:
                rows.append(dict(name=f"{preset}/{run.func.__name__}", preset=preset, **error_fields(error)))
            log(f"compile {rows[-1]['name']}: " + json.dumps({key: rows[-1].get(key) for key in (
                "first_call_s", "step_ms", "ratio_to_eager", "graphs", "graph_breaks", "tokens_equal_eager", "error")}))
    fresh_dynamo()
    return rows


# -------------------------------------------------------------------------------------------------- decoding


def decode_section(device, log, shapes=("gpt2", "llama"), batch_sizes=(1, 8), new_tokens=100, repeats=3,
                   dtype=torch.bfloat16):  # fmt: skip
    from bench_decode import BASELINE, decode_seconds, models

    rows = []
    for shape in shapes:
        try:
            built = {name: model.to(device, dtype) for name, model in models(shape).items()}
        except Exception as error:
            rows.append(dict(name=shape, shape=shape, **error_fields(error)))
            continue
        for batch in batch_sizes:
            prompt = torch.randint(1, 10000, (batch, 16), generator=torch.Generator().manual_seed(batch)).to(device)
            shape_rows = {}
            for name, model in built.items():
                row = dict(name=f"{shape}/{name}/batch{batch}", shape=shape, model=name, batch=batch,
                           new_tokens=new_tokens, dtype=str(dtype).removeprefix("torch."))  # fmt: skip
                try:
                    decode_seconds(model, prompt, 8)  # warm-up
                    with backend_spy() as chosen:
                        seconds = statistics.median(decode_seconds(model, prompt, new_tokens) for _ in range(repeats))
                    row.update(seconds=seconds, tokens_per_s=batch * new_tokens / seconds, backends=dict(chosen))
                except Exception as error:
                    row.update(error_fields(error))
                shape_rows[name] = row
            for row in shape_rows.values():
                if "seconds" in row and "seconds" in shape_rows[BASELINE]:
                    row["ratio_to_transformers"] = row["seconds"] / shape_rows[BASELINE]["seconds"]
                log(f"decode {row['name']}: {row.get('tokens_per_s', row.get('error'))} tokens/s")
            rows.extend(shape_rows.values())
    return rows


# -------------------------------------------------------------------------------------------------- main job


def main_job_arguments(output_dir, device):
    """run_clm.py's arguments for the README's main job, in bfloat16 on a GPU."""
    bf16 = ["--bf16", "true"] if device.type == "cuda" else []
    return ["plat-ptb-tiny.yaml", "--output_dir", str(output_dir), *bf16]


def main_job_section(device, log, timeout_s, script=ROOT / "run_clm.py", extra_args=()):
    with tempfile.TemporaryDirectory() as folder:
        output_dir = Path(folder) / "plat-ptb-tiny"
        command = [sys.executable, str(script), *main_job_arguments(output_dir, device), *extra_args]
        row = dict(name="plat-ptb-tiny", command=" ".join(command[1:]), timeout_s=timeout_s)
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or b"")[-3000:]
            return [dict(row, wall_s=time.perf_counter() - start, failures=[f"timed out after {timeout_s:.0f} s"],
                         output_tail=output.decode(errors="replace") if isinstance(output, bytes) else output)]
        row.update(wall_s=time.perf_counter() - start, returncode=done.returncode,
                   output_tail=(done.stdout + done.stderr)[-3000:])  # fmt: skip
        results = output_dir / "all_results.json"
        if done.returncode == 0 and results.exists():
            row["metrics"] = json.loads(results.read_text())
        else:
            row["failures"] = [f"exit status {done.returncode}" + ("" if results.exists() else ", no all_results.json")]
    log(f"main job: {row['wall_s']:.0f} s, test perplexity {row.get('metrics', {}).get('test_perplexity')}")
    return [row]


# ---------------------------------------------------------------------------------------------------- record


def find(sections, section, **fields):
    """The first row of a section that ran with these field values, or None."""
    rows = sections.get(section, {}).get("rows", [])
    return next((row for row in rows if all(row.get(key) == value for key, value in fields.items())), None)


def ratio_target(sections, section, fields, value_of, limit):
    row = find(sections, section, **fields)
    try:
        value = value_of(row)
    except (KeyError, TypeError):  # no row, or a row without the measurement (an error)
        return None, None
    return round(value, 3), value <= limit


def fullgraph_target(sections):
    rows = [row for row in sections.get("compile", {}).get("rows", []) if row.get("kind") in ("train-step", "generate")]
    broken = [row["name"] for row in rows if "error" in row or row.get("graph_breaks") != 0]
    if len(rows) < 2 * len(COMPILE_PRESETS):
        return f"{len(rows)} of {2 * len(COMPILE_PRESETS)} compiled", None
    return (f"{len(rows) - len(broken)} of {len(rows)} without graph breaks" + (f" (not: {broken})" if broken else ""),
            not broken)  # fmt: skip


def cuda_graphs_target(sections):
    row = find(sections, "compile", kind="train-step-cuda-graphs")
    if row is None or "skipped" in row:
        return None, None
    return (f"{row['step_ms']:.2f} ms/step" if "step_ms" in row else row["error"]), "step_ms" in row


def peak_memory_target(sections, names=KERNEL_SPEED_SHAPES, limit=PEAK_MEMORY_LIMIT):
    """Peak memory of a forward + backward over SDPA's default backend's at each shape; passed if the largest is
    within ``limit``, not measured unless every shape measured both."""
    ratios = {}
    for name in names:
        row = find(sections, "attention", name=name)
        with contextlib.suppress(KeyError, TypeError):
            ratios[name] = round(row["plat"]["fwd_bwd_peak_mib"] / row["sdpa"]["fwd_bwd_peak_mib"], 3)
    if len(ratios) < len(names):
        return ratios or None, None
    return ratios, max(ratios.values()) <= limit


def fused_target(sections):
    """Which timed p-LaT rows saw auto choose anything but the fused kernels (or the decode path)."""
    rows = [row for name in ("attention", "envelope", "kernels", "train", "compile", "decode")
            for row in sections.get(name, {}).get("rows", [])]  # fmt: skip
    counts = {row["name"]: row.get("plat", row)["backends"] for row in rows if "backends" in row.get("plat", row)}
    fallbacks = {name: chosen for name, chosen in counts.items() if set(chosen) - FUSED}
    if not counts:
        return None, None
    return (f"fall backs in {fallbacks}" if fallbacks else f"{len(counts)} rows on {sorted(FUSED)}"), not fallbacks


LAUNCH_HOST_US = 15


def launch_host_target(sections):
    """The paper-lm kernels row's host microseconds per Triton launch."""
    rows = [row for row in sections.get("kernels", {}).get("rows", []) if row["name"] == "paper-lm" and "host" in row]
    if not rows:
        return None, None
    per_launch = rows[0]["host"]["launch_us"] / rows[0]["host"]["launches"]
    return round(per_launch, 1), per_launch <= LAUNCH_HOST_US


# (name, the sections it needs, judge(sections) -> (value, passed: True / False / None when not measured))
TARGETS = [
    *[(f"{name} training step <= {limit} x {twin} (SDPA), bf16 autocast", ("train",),
       functools.partial(ratio_target, section="train", fields=dict(name=f"plat-{name}"),
                         value_of=lambda row: row["ratio"], limit=limit))
      for name, twin, limit in (("deit-tiny", "ViTForImageClassification", 1.2), ("lm", "GPT2LMHeadModel", 1.15),
                                ("llama-125m", "LlamaForCausalLM", 1.3))],
    ("paper-lm attention forward + backward <= 2.5 x SDPA (default backend)", ("attention",),
     lambda s: ratio_target(s, "attention", dict(name="paper-lm"), lambda row: row["ratio_to_sdpa"]["fwd_bwd"], 2.5)),
    *[(f"{name} attention {'forward' if part == 'fwd' else 'forward + backward'} <= {limit} x SDPA (default backend)",
       ("attention",), functools.partial(ratio_target, section="attention", fields=dict(name=name),
                                         value_of=lambda row, part=part: row["ratio_to_sdpa"][part], limit=limit))
      for name, part, limit in KERNEL_SPEED_TARGETS],
    (f"peak memory of an attention forward + backward <= {PEAK_MEMORY_LIMIT} x SDPA (default backend) at "
     f"{', '.join(KERNEL_SPEED_SHAPES)}", ("attention",), peak_memory_target),
    *[(f"{name} attention forward + backward <= {ENVELOPE_LIMIT} x SDPA given the same pattern", ("envelope",),
       functools.partial(ratio_target, section="envelope", fields=dict(name=name),
                         value_of=lambda row: row["ratio_to_sdpa"]["fwd_bwd"], limit=ENVELOPE_LIMIT))
      for name in ENVELOPE_SHAPES],
    (f"host time per Triton launch <= {LAUNCH_HOST_US} us (paper-lm, median over a call's launches)", ("kernels",),
     launch_host_target),
    ("compiled plat-ptb-tiny training step <= 0.8 x eager", ("compile",),
     lambda s: ratio_target(s, "compile", dict(name="plat-ptb-tiny/train-step"), lambda row: row["ratio_to_eager"],
                            0.8)),
    ("fullgraph=True, 0 graph breaks: training step and generation's forward of plat-ptb-tiny and plat-llama-tiny",
     ("compile",), fullgraph_target),
    ('mode="reduce-overhead" (CUDA graphs) training step of plat-ptb-tiny works', ("compile",), cuda_graphs_target),
    ("auto runs the fused kernels (triton; decode for a few queries) in every timed p-LaT model",
     ("attention", "envelope", "train", "compile", "decode"), fused_target),
]  # fmt: skip


def judge_targets(sections, requested):
    """A PASS / FAIL / NOT MEASURED line per target that the requested sections measure."""
    judged = []
    for name, needs, judge_target in TARGETS:
        if not set(needs) & set(requested):
            continue
        value, passed = judge_target(sections)
        verdict = {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[passed]
        judged.append(dict(target=name, value=value, passed=passed, line=f"{verdict} {name}: {value}"))
    return judged


def collect_failures(sections, targets):
    failures = []
    for name, section in sections.items():
        if section["status"] == "error":
            failures.append(f"{name}: {section['error']}")
        for row in section.get("rows", []):
            label = row.get("case") or row.get("name")
            failures += [f"{name} {label}: {failure}" for failure in row.get("failures", [])]
    return failures + [target["line"] for target in targets if not target["passed"]]


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
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count()),
                        help="processes of the correctness sweep (0: in this process)")
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
        "sweep": lambda: sweep_section(device, log, workers=args.workers, seconds=args.budget_s - log.elapsed()),
        "attention": lambda: attention_section(device, log, **timing),
        "envelope": lambda: envelope_section(device, log, **timing),
        "fallback": lambda: fallback_section(device, log),
        "kernels": lambda: kernels_section(device, log),
        "train": lambda: train_section(device, log, **timing),
        "compile": lambda: compile_section(device, log, **timing),
        "decode": lambda: decode_section(device, log),
        "main-job": lambda: main_job_section(device, log, timeout_s=args.budget_s - log.elapsed()),
    }
    sections = run_sections([(name, runs[name]) for name in dict.fromkeys(args.sections)], args.budget_s, log,
                            lambda done: write_report(path, dict(report, sections=done)))  # fmt: skip
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
