"""What the sections of the GPU check share: the GPU's clock, steps timed side by side, peak memory, seeded attention
inputs, the backends ``auto`` chose, relative errors and how a row records an error."""

import collections
import contextlib
import importlib
import statistics
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository
# Relative errors against the float64 reference, by dtype (those of tests/attention/test_backends.py).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


def no_log(message):
    """A section's log that prints nothing: precompilation's (``precompile``)."""


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


def side_by_side(steps, device, warmup, repeats):
    """Each of ``steps`` ({name: step()}) timed in ``repeats`` rounds after ``warmup`` rounds, as ``timed`` times a call.
    A round runs every step once, in an order rotated from round to round, so that what drifts during a run (the
    GPU's clocks, the host's other work) reaches every step alike, and each time has the others' of its round beside
    it (``paired_ratio``). {name: dict(seconds=[one per round], backends={backend: calls})}, the backends that
    plap_attention's dispatcher returned in its calls; a step that raised gets ``error_fields`` instead and leaves the
    later rounds."""
    results = {name: dict(seconds=[], backends=collections.Counter()) for name in steps}
    with backend_spy() as chosen:
        for round_ in range(warmup + repeats):
            running = [name for name in steps if "error" not in results[name]]
            turn = round_ % max(len(running), 1)
            for name in running[turn:] + running[:turn]:
                before = collections.Counter(chosen)
                try:
                    seconds = timed(steps[name], 0, 1, device)
                except Exception as error:
                    results[name] = error_fields(error)
                    continue
                results[name]["backends"].update(chosen - before)
                if round_ >= warmup:
                    results[name]["seconds"].append(seconds)
    return results


def paired_ratio(seconds, baseline):
    """The median over rounds of a step's time over its baseline's in the same round, and the least and the greatest
    of those ratios: how much the ratio varied within the run."""
    ratios = [ours / theirs for ours, theirs in zip(seconds, baseline, strict=True)]
    return statistics.median(ratios), (min(ratios), max(ratios))


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


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def bf16_attention_inputs(batch, heads, length, head_dim, device):
    """Seeded bfloat16 q, k, v (requiring grad) and dU of one attention shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))  # fmt: skip
    return q, k, v, torch.randn(q.shape, generator=gen, device=device, dtype=torch.bfloat16)
