"""Time and memory of each p-Laplacian attention backend, as ratios to softmax attention (SDPA).

For every shape and backend: forward time, forward+backward time (median over --repeats after
--warmup calls) and the peak memory of one forward+backward, each divided by SDPA's on the same shape in
the same run. Backends run round-robin within each repeat, so that drifts of a shared machine hit them
alike. Gradients are taken with torch.autograd.grad against a fixed random output gradient.

Every printed row and every JSON/CSV row carries the machine it was measured on (CPU model, physical cores,
threads, torch version; see machine.py): the ratios depend on the CPU far more than on anything else.

Peak memory: on CUDA, torch.cuda.max_memory_allocated above the memory held before the call. On CPU,
the peak of live bytes allocated through PyTorch's allocator during the call, summed in time order from
the profiler's memory events (profile_memory=True): the extra memory the call needs above its inputs,
without scratch space that libraries allocate themselves (oneDNN/MKL) or allocator caching.

    python benchmarks/bench_attention.py --shapes deit-tiny paper-lm --threads 1 --backends sdpa auto tiled eager
    python benchmarks/bench_attention.py --shapes deit-tiny paper-lm --out results/attention
    python benchmarks/bench_attention.py --shapes long-1k long-4k --backends tiled eager --repeats 3
"""

import argparse
import csv
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from machine import facts_label, machine_facts
from modeling_plat.plap_dispatch import choose_backend, plap_attention

# name: (batch, heads, length, head size, causal, p per head)
SHAPES = {
    "deit-tiny": (32, 3, 197, 64, False, [1.5, 1.5, 2.5]),  # DeiT-tiny/16 at 224px: 196 patches + CLS
    "paper-lm": (16, 8, 256, 16, True, [1.5] * 4 + [2.5] * 4),  # the paper's language model
    "ptb-tiny": (32, 8, 128, 16, True, [1.5] * 4 + [2.5] * 4),  # the plat-ptb-tiny preset, batch 32
    "long-1k": (1, 2, 1024, 64, True, [1.5, 2.5]),
    "long-4k": (1, 2, 4096, 64, True, [1.5, 2.5]),
    "long-16k": (1, 2, 16384, 64, True, [1.5, 2.5]),
}
BACKENDS = ("sdpa", "auto", "eager", "tiled", "triton")
# The eager backend holds several (B, H, N, N) float32 tensors; above this many scores it is skipped.
EAGER_MAX_SCORES = 2**28


def make_call(backend, q, k, v, p, causal, formulation):
    if backend == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: plap_attention(q, k, v, p, is_causal=causal, formulation=formulation, backend=backend)


def peak_bytes(fn, device):
    """Peak extra bytes allocated during fn() (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def unavailable_reason(backend, q, p):
    if backend == "sdpa":
        return None
    if backend == "eager" and q.shape[:-1].numel() * q.shape[-2] > EAGER_MAX_SCORES:
        return "skipped: (B, H, N, N) tensors too large"
    try:
        choose_backend(backend, q, q, q, p=tuple(p.tolist()))
    except ValueError as error:
        return str(error)
    return None


def bench_shape(name, backends, device, dtype, formulation, warmup, repeats, measure_memory):
    batch, heads, length, head_dim, causal, p = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, length, head_dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(3)
    )
    grad_out = torch.randn(batch, heads, length, head_dim, generator=gen).to(device, dtype)
    p = torch.tensor(p, device=device)
    runs = {}
    rows = []
    for backend in backends:
        reason = unavailable_reason(backend, q, p)
        if reason is not None:
            rows.append(dict(shape=name, backend=backend, status=reason))
            continue
        forward = make_call(backend, q, k, v, p, causal, formulation)

        def forward_backward(forward=forward):
            torch.autograd.grad(forward(), (q, k, v), grad_out)

        runs[backend] = (forward, forward_backward)
    times = {backend: ([], []) for backend in runs}
    for step in range(warmup + repeats):
        for backend, (forward, forward_backward) in runs.items():
            with torch.no_grad():
                fwd = timed(forward, device)
            fwd_bwd = timed(forward_backward, device)
            if step >= warmup:
                times[backend][0].append(fwd)
                times[backend][1].append(fwd_bwd)
    for backend, (forward, forward_backward) in runs.items():
        fwd, fwd_bwd = (statistics.median(t) * 1e3 for t in times[backend])
        peak = peak_bytes(forward_backward, device) / 2**20 if measure_memory else float("nan")
        rows.append(dict(shape=name, backend=backend, status="ok", fwd_ms=fwd, fwd_bwd_ms=fwd_bwd, peak_mib=peak))
    base = next((r for r in rows if r["backend"] == "sdpa" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] == "ok" and base is not None:
            row["fwd_ratio"] = row["fwd_ms"] / base["fwd_ms"]
            row["fwd_bwd_ratio"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]
            row["peak_ratio"] = row["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else float("nan")
        row.update(batch=batch, heads=heads, length=length, head_dim=head_dim, causal=causal)
    return rows


def print_table(rows, facts):
    header = f"{'shape':<10} {'backend':<7} {'fwd ms':>9} {'x sdpa':>7} {'fwd+bwd ms':>11} {'x sdpa':>7} {'peak MiB':>9} {'x sdpa':>7}"
    print(header + "  machine")
    print("-" * (len(header) + 9))
    label = facts_label(facts)
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['shape']:<10} {r['backend']:<7} {r['status']}")
            continue
        print(
            f"{r['shape']:<10} {r['backend']:<7} {r['fwd_ms']:>9.2f} {r.get('fwd_ratio', float('nan')):>7.2f} "
            f"{r['fwd_bwd_ms']:>11.2f} {r.get('fwd_bwd_ratio', float('nan')):>7.2f} {r['peak_mib']:>9.2f} "
            f"{r.get('peak_ratio', float('nan')):>7.2f}  {label}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["deit-tiny", "paper-lm"])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--formulation", choices=["paper", "euler"], default="paper")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: PyTorch's choice)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--out", type=Path, help="directory for attention.json and attention.csv")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = ["sdpa"] + [b for b in args.backends if b != "sdpa"]  # the baseline of every ratio
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    facts = machine_facts(device)
    env = dict(
        **facts,
        dtype=args.dtype,
        formulation=args.formulation,
        warmup=args.warmup,
        repeats=args.repeats,
        load_average_before=os.getloadavg(),
    )
    print(json.dumps(env))
    rows = []
    for name in args.shapes:
        rows += bench_shape(
            name, backends, device, dtype, args.formulation, args.warmup, args.repeats, not args.no_memory
        )
    env["load_average_after"] = os.getloadavg()
    for row in rows:
        row.update(facts)
    print_table(rows, facts)
    print(f"load average before {env['load_average_before']}, after {env['load_average_after']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention.json").write_text(json.dumps(dict(environment=env, results=rows), indent=2))
        fields = sorted({key for row in rows for key in row})
        with open(args.out / "attention.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
