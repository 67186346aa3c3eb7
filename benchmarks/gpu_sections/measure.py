"""What the sections of the GPU check share: the GPU's clock, peak memory, seeded attention inputs, the backends
``auto`` chose, relative errors and how a row records an error."""

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


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def bf16_attention_inputs(batch, heads, length, head_dim, device):
    """Seeded bfloat16 q, k, v (requiring grad) and dU of one attention shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))  # fmt: skip
    return q, k, v, torch.randn(q.shape, generator=gen, device=device, dtype=torch.bfloat16)
