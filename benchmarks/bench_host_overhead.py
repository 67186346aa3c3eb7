"""Host work of one p-LaT attention call, the part a GPU waits for at small shapes, measured on the CPU.

    python benchmarks/bench_host_overhead.py [--shape 16 8 256 16] [--repeats 7] [--calls 300]

At the paper LM's attention shape a fused forward + backward on a GPU is ~0.12 ms of kernels and was ~1.7 ms of wall
time: the dispatcher, the custom ops, the launches and the small auxiliary kernels decide it. This runs the Triton
backend's host code on CPU tensors with every kernel launch replaced by a no-op, at the shape's batch and heads and a
short length (so that the auxiliary tensor operations cost what their launches cost, not their arithmetic), and
prints per call, forward and forward + backward:
- the host time of the eager path (``FusedOp`` calling the backend's functions through a plain autograd Function),
  of the same call through torch.library's custom-op dispatcher (what compiled graphs call), of SDPA at the same
  shape, and of one attention layer as a model runs it (PlatAttention: the projections, whose views q, k and v are,
  around the attention) with the paper's p and with p = 2 (SDPA), interleaved, the fastest of ``--repeats`` rounds of
  ``--calls`` calls (what the code costs, without the time a shared machine's other work takes from a round; SDPA's
  arithmetic and the projections' are real CPU work, and in their times; only the Triton kernels are no-ops);
- the Triton launches and the ATen operations (allocations and views included; most are a kernel launch on a GPU)
  per call, counted exactly, and among them the copies into another layout;
- the Python bytecodes one call executes (``sys.settrace``), in ``modeling_plat`` and in all: the host's Python work,
  counted exactly whatever the machine's speed and load (a VM's timings vary by 10% or more from run to run);
- the Python time of one launch through ``triton_launcher.BoundLaunches`` (its key, lookup and arguments), the
  compiled kernel a no-op: on a GPU Triton's own launcher adds its time to this.

``--against CHECKOUT`` times another checkout's ``modeling_plat`` (copied beside this one under another name) in the
same rounds, interleaved call block by call block, and prints each row's ratio, this / that: the fastest against the
fastest, and the middle half of the rounds' own ratios, so that a change is measured side by side on one machine.
"""

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors may take the Triton path; no kernel runs (below)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from machine import facts_label, machine_facts  # noqa: E402

P_MIX = (1.5, 2.5)


def package(name):
    """The modules of the ``modeling_plat`` package importable as ``name`` that this benchmark calls."""
    return SimpleNamespace(root=importlib.import_module(name),
                           triton=importlib.import_module(f"{name}.plap_attention_triton"),
                           launcher=importlib.import_module(f"{name}.triton_launcher"),
                           modeling=importlib.import_module(f"{name}.modeling_plat"))  # fmt: skip


def package_of_checkout(checkout):
    """Another checkout's ``modeling_plat``, copied into a temporary folder as ``modeling_plat_against`` so that both
    import in one process (its custom ops are named after the copy's module path, apart from this one's)."""
    folder = Path(tempfile.mkdtemp(prefix="plat-against-"))
    shutil.copytree(Path(checkout) / "modeling_plat", folder / "modeling_plat_against")
    sys.path.insert(0, str(folder))
    return package("modeling_plat_against")


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations that run (each a kernel launch on a GPU), views and metadata ones included, and
    among them the copies of a tensor into a new layout (``contiguous``, ``reshape`` of a strided view)."""

    def __init__(self):
        super().__init__()
        self.count = self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.copies += func is torch.ops.aten.clone.default
        return func(*args, **(kwargs or {}))


def inputs(batch, heads, length, head_dim):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=gen).requires_grad_() for _ in range(3))
    p = tuple(P_MIX[h * len(P_MIX) // heads] for h in range(heads))  # the paper's mix: half 1.5, half 2.5
    return q, k, v, p, torch.ones(batch, heads, length, head_dim)


def calls(modules, q, k, v, p, grad):
    """name -> (forward, forward + backward) callables of the package ``modules``."""

    def plat(through_op):
        def forward():
            with torch.no_grad():
                return run(through_op)

        def both():
            run(through_op).backward(grad)

        return forward, both

    def run(through_op):
        fused = modules.triton._fused
        original = type(fused).__call__
        if through_op:
            type(fused).__call__ = lambda self, *a: self.forward_op(*a)
        try:
            return modules.root.plap_attention(q, k, v, p, is_causal=True, backend="triton")
        finally:
            type(fused).__call__ = original

    def sdpa_forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {
        "plat (eager path)": plat(False),
        "plat (custom-op dispatcher)": plat(True),
        "sdpa": (sdpa_forward, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)),
        "plat layer (PlatAttention)": layer_calls(modules, q.shape, p, "triton"),
        "p = 2 layer (SDPA)": layer_calls(modules, q.shape, 2.0, "auto"),
    }


def layer_calls(modules, shape, p, backend):
    """(forward, forward + backward) of one PlatAttention layer of B x N tokens of H * d features: its projections
    around the attention, whose q, k and v are views of them, as in a model."""
    batch, heads, length, head_dim = shape
    config = modules.root.PlatConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_hidden_layers=1,
                                     plap_p=p, plap_backend=backend)  # fmt: skip
    torch.manual_seed(0)
    attention = modules.modeling.PlatAttention(config, 0, is_causal=True)
    hidden = torch.randn(batch, length, heads * head_dim, requires_grad=True)
    grad = torch.ones_like(hidden)

    def forward():
        with torch.no_grad():
            return attention(hidden)[0]

    return forward, lambda: attention(hidden)[0].backward(grad)


class NoOpKernel:
    """Stands in for a Triton kernel: its launch "compiles" a kernel whose run does nothing."""

    params = []

    def __getitem__(self, grid):
        return lambda *args, **meta: NoOpKernel.Compiled()

    class Compiled:
        function = packed_metadata = None

        def run(self, *args):
            pass


def bytecodes(fn, modules):
    """(in the package of ``modules``, in all) Python bytecodes that one fn() executes."""
    package = str(Path(modules.triton.__file__).parent)
    counts = [0, 0]

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[0] += frame.f_code.co_filename.startswith(package)
            counts[1] += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return counts


def bound_launch_us(modules, launches, count):
    """Microseconds of Python per launch of a call's launches through BoundLaunches, after the first (binding)."""
    bound = modules.launcher.BoundLaunches()
    bound.enabled, bound.current_stream = True, lambda device: None
    kernel = NoOpKernel()
    launches = [launch._replace(kernel=kernel) for launch in launches]
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # a CPU machine has none to ask
    try:
        for launch in launches:
            bound(launch)
        return per_call_us(lambda: [bound(launch) for launch in launches], count) / len(launches)
    finally:
        torch.cuda.current_device = current_device


def per_call_us(fn, count):
    start = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - start) / count * 1e6


def ratio_text(this, that):
    """this / that of one row: fastest against fastest, and the middle half of the paired rounds' ratios."""
    ratios = sorted(a / b for a, b in zip(this, that))
    middle = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    return f"{min(this) / min(that):.3f} (rounds {middle[0]:.3f}-{middle[1]:.3f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[16, 8, 256, 16], metavar=("B", "H", "N", "D"),
                        help="the attention shape whose batch, heads and head size are used (default: the paper LM)")
    parser.add_argument("--length", type=int, default=16, help="the sequence length actually run (short: host work)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--against", metavar="CHECKOUT",
                        help="another checkout (its modeling_plat) timed in the same rounds, for ratios")
    args = parser.parse_args(argv)
    batch, heads, _, head_dim = args.shape
    versions = {"": package("modeling_plat")}
    if args.against:
        versions[" [against]"] = package_of_checkout(args.against)
    # Launches are kept only while a call's are counted: kept tensors would make every allocation a fresh one.
    launches, counting = [], [False]
    for modules in versions.values():
        modules.triton._run = lambda launch, query, value: launches.append(launch) if counting[0] else None
    q, k, v, p, grad = inputs(batch, heads, args.length, head_dim)
    rows = {version: calls(modules, q, k, v, p, grad) for version, modules in versions.items()}
    cases = {(name, version): (versions[version], rows[version][name]) for name in rows[""] for version in versions}
    for _, (forward, both) in cases.values():  # warm-up, and every path checked to run
        forward(), both()
    times = {(case, part): [] for case in cases for part in ("fwd", "fwd+bwd")}
    for round_ in range(args.repeats):
        order = list(versions)[:: 1 if round_ % 2 == 0 else -1]  # which version goes first alternates
        for name in rows[""]:  # each row's versions one after the other
            for version in order:
                forward, both = cases[name, version][1]
                times[(name, version), "fwd"].append(per_call_us(forward, args.calls))
                times[(name, version), "fwd+bwd"].append(per_call_us(both, args.calls))
    print(f"host time per call, B={batch} H={heads} N={args.length} d={head_dim}, p mix {P_MIX}, launches no-ops "
          f"(fastest of {args.repeats} x {args.calls}); {facts_label(machine_facts(torch.device('cpu')))}"
          + (f"; [against]: {args.against}" if args.against else ""))  # fmt: skip
    for (name, version), (modules, (forward, both)) in cases.items():
        fwd, fwd_bwd = (min(times[(name, version), part]) for part in ("fwd", "fwd+bwd"))
        line = f"  {name + version:40s} fwd {fwd:8.1f} us  fwd+bwd {fwd_bwd:8.1f} us"
        if "dispatcher" not in name:  # there the op hides its own operations from the counter
            counts = []
            for fn in (forward, both):
                launches.clear()
                counting[0] = True
                with OpCounter() as counter:
                    fn()
                counting[0] = False
                counts.append(f"{len(launches)} + {counter.count} ({counter.copies} copies)")
            line += f"   Triton launches + ATen ops: fwd {counts[0]}, fwd+bwd {counts[1]}"
            ours, every = bytecodes(both, modules)
            line += f"; Python bytecodes fwd+bwd: {ours} in modeling_plat, {every} in all"
        print(line)
        if version:
            ratios = [ratio_text(times[(name, ""), part], times[(name, version), part]) for part in ("fwd", "fwd+bwd")]
            print(f"  {'':40s} this / against: fwd {ratios[0]}, fwd+bwd {ratios[1]}")
    for version, modules in versions.items():
        launches.clear()
        counting[0] = True
        cases["plat (eager path)", version][1][1]()
        counting[0] = False
        recorded = list(launches)
        per_launch = min(bound_launch_us(modules, recorded, args.calls) for _ in range(args.repeats))
        print(f"  one bound launch{version}, Python side (compiled kernel a no-op): {per_launch:.2f} us")


if __name__ == "__main__":
    main()
