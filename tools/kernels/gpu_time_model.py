"""Predicted times of the fused Triton kernels on Hopper, calibrated on an H200 and an H100 and computed without a GPU.

    python tools/kernels/gpu_time_model.py              # today's kernels at the kernel-speed targets' shapes
    python tools/kernels/gpu_time_model.py --calibrate  # refit LATENCY_HIDING on the measured kernels (CALIBRATIONS)
    python tools/kernels/gpu_time_model.py --as-compiled  # also as torch.compile compiles them, against eager

``gpu_static_cost.py`` counts what each score costs at the pipes' full rate. Nsight Compute on an H200 showed the
kernels far from it: at 207-255 registers per thread one block of 8 warps fits an SM, 2 warps per scheduler, and the
schedulers issue in about a third of their clocks (IPC 1.49 of 4). This model adds that:

- residency: blocks per SM from registers per thread (allocated per warp in units of 256), warps per block and shared
  memory per block, against the SM's 65,536 registers, 64 warps, 32 blocks and 228 KB (sm_90);
- latency hiding: a scheduler with ``w`` resident warps issues in ``1 - (1 - LATENCY_HIDING) ** w`` of its clocks,
  each warp ready in a clock with the same chance, fitted to the measurements below;
- clocks per score = the slowest of: the loop's instructions at that issue rate, and the special-function, FP32 and
  tensor pipes at their full rates (floors that no latency hiding lowers; taking all of them at the reduced rate fit
  the measurements worse, -15% to +35%);
- time of a launch: each program (row block) takes the scores its loop visits (the diagonal's waste included) x clocks
  per score x the blocks sharing its SM; the programs start in grid order as resident places free, as a GPU hands out
  blocks, and the launch ends with its last program. Under causal masking the loops' lengths differ, so that the order
  decides the tail: the kernels of the calibration commit ran each slab's row blocks from the shortest (16% above the
  average per SM at 4k tokens), today's run the longest first (1%);
- auxiliary tensor operations (norms, reductions, casts) = the bytes they read and write, counted by running the
  backend's host code on meta tensors, at the effective bandwidth the same profile showed;
- peak memory of a forward + backward: the storages that the backend's host code allocates on CPU tensors (launches
  left out), live while a tensor holds them, as ``torch.cuda.max_memory_allocated`` counts them on a GPU. Nothing is
  fitted: for the kernels of the calibration commit it gives 194 MiB where the H200 measured 195, for today's 97.5
  where an H100 measured 98.5.

What it cannot see: memory stalls (dQ at head size 128 ran at 75% of the memory throughput), spills, L2 misses, launch
latency and host work. The exact passes are not modelled (empty on random inputs: 6-8 us each measured on an H200).
One chance fits kernels at 2 warps per scheduler (059074d) and at 2-4 (2ad903c's and 5eb1d43's) within -21% to +18%,
with a trend: those of 059074d come out slower than measured (+11 to +18%, but dK/dV at d = 128), the later ones
faster (+3 to -10%; 5eb1d43's dQ at d = 128 -21%). The curve gives occupancy more than the GPU did: a design that
gains by occupancy alone gains less than predicted.

A GPU's synchronised calls also wait for the host before the first kernel: an H100 measured 250 us per forward and
about 1 ms per forward + backward of host work at the paper LM's shape, where the kernels take a few microseconds.
"""

import argparse
import contextlib
import heapq
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpu_static_cost
from modeling_plat import paper_p_mix

ROOT = Path(__file__).resolve().parents[2]
# Per-SM residency limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"; 1 KB of
# shared memory per block is reserved by the system).
RESIDENCY = {
    90: dict(registers=65536, warps=64, blocks=32, shared=233472),
    80: dict(registers=65536, warps=64, blocks=32, shared=167936),
}
RESERVED_SHARED = 1024
REGISTER_UNIT = 256  # registers are allocated per warp in multiples of this
# H100 / H200 SXM: 132 SMs at 1.98 GHz boost; the calibration's fitted constants absorb the clock's real value.
GPU = dict(arch=90, sms=132, clock_hz=1.98e9)
# The chance that a resident warp can issue in a given clock; refit by --calibrate (figures below).
LATENCY_HIDING = 0.146
# Effective bandwidth of the auxiliary tensor operations (bytes per second), refit by --calibrate.
AUXILIARY_BANDWIDTH = 2.41e12

# How each version launches a causal call of the paper mix: 059074d one launch per value of p, its slabs slab major;
# 2ad903c one launch for both, heaviest programs first (GRID_ORDERS below); today, at the calls modelled here (two
# passes), one launch per p again, heaviest programs first.
CALIBRATION_GRID = dict(launch_per_p=True, order="slab major")
JOINED_GRID = dict(launch_per_p=False, order="heavy first")
CURRENT_GRID = dict(launch_per_p=True, order="heavy first")
# Each attention kernel's time per launch (us), bf16, 2 x 16 heads x 4096 tokens, causal, in two measured sets: the
# kernels of each commit analysed in a checkout of it, launched in its own grid order. Every head at p = 1.5 (one
# launch per kernel) or the paper's mix.
CALIBRATION_SHAPE = dict(batch=2, heads=16, tokens=4096)
CALIBRATIONS = [
    # An NVIDIA H200 (torch 2.11.0+cu130, Triton 3.6.0): Nsight Compute at p = 1.5, a profile of the paper mix (two
    # launches per kernel, one per p: their sum). One block of 8 warps per SM: 2 warps per scheduler.
    dict(commit="059074d", grid=CALIBRATION_GRID, source="H200, Nsight Compute", kernels=[
        dict(kernel="fwd", head_dim=64, p=(1.5,), us=553),
        dict(kernel="dkdv", head_dim=64, p=(1.5,), us=1250),
        dict(kernel="dq", head_dim=64, p=(1.5,), us=1140),
        dict(kernel="fwd", head_dim=128, p=(1.5,), us=890),
        dict(kernel="dkdv", head_dim=128, p=(1.5,), us=2520),
        dict(kernel="dq", head_dim=128, p=(1.5,), us=3990, memory_bound=True),
        dict(kernel="fwd", head_dim=64, p=(1.5, 2.5), us=631),
        dict(kernel="dkdv", head_dim=64, p=(1.5, 2.5), us=1412),
        dict(kernel="dq", head_dim=64, p=(1.5, 2.5), us=1304),
    ]),
    # An NVIDIA H100 80GB HBM3 (the same software), benchmarks/gpu_check.py's kernels section (torch.profiler, median
    # of 5), benchmarks/results/gpu_check-h100-80gb-hbm3-2026-11-26.json: the first passes (the exact passes, empty
    # on random inputs, are not modelled). 2 to 4 warps per scheduler. The same run measured 059074d's kernels within
    # 1% of the H200's figures above at p = 1.5 (552, 1248, 1142 us).
    dict(commit="2ad903c", grid=JOINED_GRID, source="H100, torch.profiler", kernels=[
        dict(kernel="fwd", head_dim=64, p=(1.5,), us=395.5),
        dict(kernel="dkdv", head_dim=64, p=(1.5,), us=794.3),
        dict(kernel="dq", head_dim=64, p=(1.5,), us=784.5),
        dict(kernel="fwd", head_dim=64, p=(1.5, 2.5), us=430.8),
        dict(kernel="dkdv", head_dim=64, p=(1.5, 2.5), us=832.9),
        dict(kernel="dq", head_dim=64, p=(1.5, 2.5), us=833.5),
        dict(kernel="fwd", head_dim=128, p=(1.5, 2.5), us=668.9),
        dict(kernel="dkdv", head_dim=128, p=(1.5, 2.5), us=1819.9),
        dict(kernel="dq", head_dim=128, p=(1.5, 2.5), us=1649.6),
    ]),
    # An NVIDIA H200 (the same software), benchmarks/gpu_check.py's kernels section,
    # benchmarks/results/gpu_check-h200-2026-11-30-5eb1d43.json: the first passes, one launch per p (the paper mix:
    # the sum of its two). 3 warps per scheduler at head size 64, 2 at 128.
    dict(commit="5eb1d43", grid=CURRENT_GRID, source="H200, torch.profiler", kernels=[
        dict(kernel="fwd", head_dim=64, p=(1.5,), us=371.3),
        dict(kernel="dkdv", head_dim=64, p=(1.5,), us=563.7),
        dict(kernel="dq", head_dim=64, p=(1.5,), us=496.7),
        dict(kernel="fwd", head_dim=64, p=(1.5, 2.5), us=393.4),
        dict(kernel="dkdv", head_dim=64, p=(1.5, 2.5), us=624.1),
        dict(kernel="dq", head_dim=64, p=(1.5, 2.5), us=540.1),
        dict(kernel="fwd", head_dim=128, p=(1.5, 2.5), us=678.4),
        dict(kernel="dkdv", head_dim=128, p=(1.5, 2.5), us=985.8),
        dict(kernel="dq", head_dim=128, p=(1.5, 2.5), us=987.7),
    ]),
]
# The H200 run's other figures, of 059074d: its auxiliary operations at 4k x 64 (the profile), whole calls
# (forward, forward + backward in ms, medians of 15) beside the fit, the shapes other than 4k x 64 out of sample.
CALIBRATION_COMMIT = CALIBRATIONS[0]["commit"]
MEASURED_AUXILIARY_US = dict(head_dim=64, us=300)
MEASURED_CALLS_MS = [
    dict(shape=(8, 12, 1024, 64), ms=(0.622, 2.222)),
    dict(shape=(2, 16, 4096, 64), ms=(1.033, 3.964)),
    dict(shape=(2, 16, 4096, 128), ms=(1.273, 8.900)),
    dict(shape=(1, 8, 16384, 64), ms=(2.587, 12.15)),
]
# Peak memory of a forward + backward (MiB beyond the inputs and dU, torch.cuda.max_memory_allocated) in the same run:
# the same at both shapes, B x H x N being equal.
MEASURED_PEAK_MIB = [dict(shape=shape, plat=195, sdpa=97) for shape in ((2, 16, 4096, 64), (1, 8, 16384, 64))]
# The kernel-speed targets: (B, H, N, d) causal, bf16, plat / SDPA's default backend, SDPA's figures measured beside
# the H100 set above (forward, forward + backward in ms, peak MiB), and the ratios to reach (None: no target).
TARGETS = [
    dict(shape=(2, 16, 4096, 64), sdpa_ms=(0.2249, 0.7658), sdpa_peak_mib=97.0, target=(2.0, 2.5)),
    dict(shape=(2, 16, 4096, 128), sdpa_ms=(0.2809, 1.1067), sdpa_peak_mib=193.0, target=(None, 3.0)),
    dict(shape=(1, 8, 16384, 64), sdpa_ms=(0.669, 2.2207), sdpa_peak_mib=97.0, target=(None, 2.5)),
]
PEAK_MEMORY_TARGET = 1.2  # x SDPA's
PAPER_MIX = (1.5, 2.5)


def residency(registers, num_warps, shared, arch=GPU["arch"]):
    """(blocks per SM, warps per scheduler) of a kernel with these resources."""
    limits = RESIDENCY[arch]
    per_warp = math.ceil(registers * 32 / REGISTER_UNIT) * REGISTER_UNIT
    blocks = min(limits["registers"] // (per_warp * num_warps), limits["warps"] // num_warps, limits["blocks"],
                 limits["shared"] // (shared + RESERVED_SHARED))  # fmt: skip
    return blocks, blocks * num_warps / 4


def issue_fraction(warps_per_scheduler, ready=None):
    """The share of clocks in which a scheduler with this many warps issues."""
    ready = LATENCY_HIDING if ready is None else ready
    return 1 - (1 - ready) ** warps_per_scheduler


def block_scores(kernel, config, tokens, is_causal):
    """Scores that the loop of each row block of one (batch, head) visits, N = ``tokens`` queries and keys: the forward
    and dQ tile each query block's keys up to its last query, dK/dV each key block's queries from its first key."""
    block_m, block_n = config["block_m"], config["block_n"]
    if not is_causal:
        fixed, loop = (block_n, block_m) if kernel == "dkdv" else (block_m, block_n)  # a program's block, its loop's
        return [math.ceil(tokens / loop) * loop * fixed] * math.ceil(tokens / fixed)
    if kernel == "dkdv":
        return [math.ceil((tokens - start // block_m * block_m) / block_m) * block_m * block_n
                for start in range(0, tokens, block_n)]  # fmt: skip
    return [math.ceil(min(tokens, start + block_m) / block_n) * block_n * block_m for start in range(0, tokens, block_m)]


def visited_scores(kernel, config, tokens, is_causal):
    """Scores a kernel's tiles cover in one (batch, head), the diagonal's waste included."""
    return sum(block_scores(kernel, config, tokens, is_causal))


# The order in which a launch's grid runs its programs: "slab major" (each slab's row blocks in turn, the first block
# first: the kernels of CALIBRATION_COMMIT) or "heavy first" (the slabs fastest, the row blocks from the longest loop
# to the shortest: ``triton_tiles.program_ids``).
GRID_ORDERS = ("slab major", "heavy first")


def program_order(kernel, num_blocks, slabs, is_causal, order):
    """(row block, slab) of each program of a launch, in grid order."""
    if order == "slab major":
        return [(block, slab) for slab in range(slabs) for block in range(num_blocks)]
    heavy_last = is_causal and kernel != "dkdv"  # causal query blocks: the last sees the most keys
    blocks = range(num_blocks - 1, -1, -1) if heavy_last else range(num_blocks)
    return [(block, slab) for block in blocks for slab in range(slabs)]


def busiest_slot(seconds, slots):
    """The finishing time of a launch whose programs take ``seconds`` each, started in that order on ``slots`` resident
    places as each frees (how a GPU hands out a grid's blocks)."""
    finish = [0.0] * slots
    for duration in seconds:
        heapq.heapreplace(finish, finish[0] + duration)
    return max(finish)


def clocks_per_score(analysis, ready=None):
    """SM clocks per score: the issue pipe at the rate its resident warps sustain, the others at their full rate
    (each a floor that latency cannot lower)."""
    _, warps = residency(analysis["registers"], analysis["config"]["num_warps"], analysis["shared"])
    return max(analysis["issue"] / issue_fraction(warps, ready), analysis["mufu"], analysis["fp32"],
               analysis["tensor"])  # fmt: skip


def launch_seconds(slab_analyses, kernel, tokens, is_causal, order, ready=None):
    """Predicted time of one launch of ``kernel`` whose slabs (batch x heads, in grid order) have these analyses (one
    per slab: each head's p compiles its own power): every program at its SM's rate shared by the blocks resident
    there, started in grid order, the launch done when its last program is (the grid's tail included)."""
    first = slab_analyses[0]
    blocks, _ = residency(first["registers"], first["config"]["num_warps"], first["shared"])
    scores = block_scores(kernel, first["config"], tokens, is_causal)
    slab_clocks = [clocks_per_score(analysis, ready) * blocks for analysis in slab_analyses]
    programs = program_order(kernel, len(scores), len(slab_analyses), is_causal, order)
    seconds = [scores[block] * slab_clocks[slab] / GPU["clock_hz"] for block, slab in programs]
    return busiest_slot(seconds, GPU["sms"] * blocks)


class ByteCounter(TorchDispatchMode):
    """Bytes read and written by the ATen operations that move data (views and allocations excluded)."""

    FREE = {"empty", "empty_like", "new_empty", "empty_strided", "view", "_unsafe_view", "expand", "slice", "select",
            "t", "transpose", "permute", "unsqueeze", "squeeze", "alias", "detach", "as_strided",
            "contiguous"}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.operations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in self.FREE:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            moved = sum(t.numel() * t.element_size() for t in tensors)
            self.bytes += moved
            self.operations.append((name, moved))
        return out


class HostCalls:
    """The Triton backend's forward and backward host functions (a causal, paper-formulation call) with its launches
    handed to ``on_launch`` instead of run: what a call allocates and moves, without a GPU."""

    def __init__(self, triton_module, batch, heads, tokens, head_dim, p, dtype=torch.bfloat16, device="meta"):
        shape = (batch, heads, tokens, head_dim)
        self.module, self.p = triton_module, list(p)
        self.query, self.key, self.value, self.grad_out = (torch.empty(shape, device=device, dtype=dtype)
                                                           for _ in range(4))  # fmt: skip
        self.config = triton_module._flat(triton_module.launch_config(dtype, head_dim, head_dim, (9, 0)))
        # The host functions of the custom ops (CALIBRATION_COMMIT's module has only the ops, which hold them).
        self.fused_forward = getattr(triton_module, "_fused_forward", None) or triton_module._forward_op._init_fn
        self.fused_backward = getattr(triton_module, "_fused_backward", None) or triton_module._backward_op._init_fn
        # The sliding window's size, an argument since the windows were fused (none in the calibration commits).
        self.window = (0,) if "window" in inspect.signature(self.fused_forward).parameters else ()

    @contextlib.contextmanager
    def launches_to(self, on_launch):
        original = self.module._run
        self.module._run = on_launch
        try:
            yield
        finally:
            self.module._run = original

    def forward(self):
        """What the forward saves for the backward: the output, the row statistics, the values' norms, the flags."""
        return self.fused_forward(self.query, self.key, self.value, None, None, self.p, True, *self.window, 1e-6,
                                  False, self.config)  # fmt: skip

    def backward(self, saved):
        return self.fused_backward(self.grad_out, self.query, self.key, self.value, None, None, *saved, self.p, True,
                                   *self.window, 1e-6, False, self.config)  # fmt: skip


# The three attention kernels' names in the Triton module: today's, and the calibration commits' (before the kernels
# moved to modules of their own).
ATTENTION_KERNELS = ("plap_forward_kernel", "plap_dkdv_kernel", "plap_dq_kernel", "_plap_fwd_kernel",
                     "_plap_bwd_dkdv_kernel", "_plap_bwd_dq_kernel")  # fmt: skip


def auxiliary_bytes(triton_module, batch, heads, tokens, head_dim, p, dtype=torch.bfloat16):
    """(forward, backward) bytes moved by the Triton backend's work besides its three attention kernels, on meta
    tensors: tensor operations, and the auxiliary kernels' tensors (each read or written once); no kernel runs."""
    calls = HostCalls(triton_module, batch, heads, tokens, head_dim, p, dtype)
    main_kernels = {getattr(triton_module, name) for name in ATTENTION_KERNELS if hasattr(triton_module, name)}
    counters = []

    def count(launch, query, value):
        if launch.kernel not in main_kernels:
            tensors = {id(t): t for t in launch.args if isinstance(t, torch.Tensor)}.values()
            counters[-1].bytes += sum(t.numel() * t.element_size() for t in tensors)

    with calls.launches_to(count):
        with ByteCounter() as forward:
            counters.append(forward)
            saved = calls.forward()
        with ByteCounter() as backward:
            counters.append(backward)
            calls.backward(saved)
    return forward.bytes, backward.bytes


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ATen operations allocate, while any tensor holds them, and their peak. Storages
    that exist before (the inputs) are not counted, nor their views."""

    def __init__(self, existing=()):
        super().__init__()
        self.level = self.peak = 0
        self.external = {tensor.untyped_storage().data_ptr() for tensor in existing}
        self.storages = {}  # data pointer -> [bytes, live tensors]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._hold(tensor)
        return out

    def _hold(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.external:
            return
        if key not in self.storages:
            self.storages[key] = [storage.nbytes(), 0]
            self.level += storage.nbytes()
            self.peak = max(self.peak, self.level)
        self.storages[key][1] += 1
        weakref.finalize(tensor, self._release, key)  # tensors that autograd saves live as long as it keeps them

    def _release(self, key):
        entry = self.storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.storages[key]
            self.level -= entry[0]


def peak_bytes(triton_module, batch, heads, tokens, head_dim, p, dtype=torch.bfloat16):
    """Bytes that one forward + backward of the Triton backend holds at its peak beyond its inputs and dU (allocated
    before, as the GPU check's peak_memory_mib counts on a GPU): its host functions on CPU tensors, launches left out;
    the forward's outputs live until the backward has returned the gradients, as under autograd."""
    calls = HostCalls(triton_module, batch, heads, tokens, head_dim, p, dtype, device="cpu")
    existing = (calls.query, calls.key, calls.value, calls.grad_out)
    with calls.launches_to(lambda launch, query, value: None), LiveBytes(existing) as live:
        saved = calls.forward()
        grads = calls.backward(saved)
        del saved, grads
    return live.peak


def as_torch_compile_builds(launch):
    """The launch as Inductor compiles it under torch.compile: without the first passes' register caps, which it passes
    no user kernel (``triton_launcher.UNTRACED_OPTIONS``). It leaves floating-point fusion to Triton's default too,
    which the main loops do not depend on (``gpu_static_cost.py --unfused``): the launch keeps the eager one's, so that
    kernels without a cap are the eager ones."""
    return launch._replace(meta={name: value for name, value in launch.meta.items() if name != "maxnreg"})


# gpu_static_cost.analyse_once's memo for every call of ``analyses`` in this process: Triton's cache, which lasts as
# long, hands a kernel compiled before back without the log that holds its registers.
_ANALYSED = {}


def analyses(head_dims, p_values, compiled=False):
    """{(kernel, head_dim, p): gpu_static_cost analysis} of the kernels that ``modeling_plat`` holds now, compiled for
    sm_90, bf16, causal, as the eager launches build them or, where ``compiled``, as torch.compile does."""
    from modeling_plat import plap_attention_triton as triton_module

    result = {}
    for head_dim in head_dims:
        for p in p_values:
            case = dict(arch=GPU["arch"], dtype="bfloat16", head_dim=head_dim, value_dim=head_dim, is_causal=True,
                        key_mask=False, euler=False, num_queries=1024, num_keys=1024, p=p)  # fmt: skip
            for kernel, launch in gpu_static_cost.plat_launches(triton_module, case, p).items():
                launch = as_torch_compile_builds(launch) if compiled else launch
                result[kernel, head_dim, p] = gpu_static_cost.analyse_once(launch, GPU["arch"], _ANALYSED)
    return result




def predict(found, aux, batch, heads, tokens, head_dim, p, ready=None, bandwidth=None, grid=None):
    """Predicted (forward, forward + backward) seconds and each kernel's, causal: each head at its p's cost, each launch
    with its tail (launch latency and host work not modelled)."""
    bandwidth = AUXILIARY_BANDWIDTH if bandwidth is None else bandwidth
    grid = CURRENT_GRID if grid is None else grid
    groups = [[value for value in p if value == chosen] for chosen in sorted(set(p))] if grid["launch_per_p"] else [p]
    kernels = {}
    for kernel in ("fwd", "dkdv", "dq"):
        kernels[kernel] = sum(
            launch_seconds([found[kernel, head_dim, value] for _ in range(batch) for value in group], kernel, tokens,
                           True, grid["order"], ready)
            for group in groups
        )  # fmt: skip
    forward = kernels["fwd"] + aux[0] / bandwidth
    return forward, forward + kernels["dkdv"] + kernels["dq"] + aux[1] / bandwidth, kernels


def calibration_inputs(json_path):
    """Run in a checkout of a commit's modeling_plat: its analyses, auxiliary and peak bytes, as JSON."""
    from modeling_plat import plap_attention_triton as triton_module

    found = analyses((64, 128), PAPER_MIX)
    shapes = [call["shape"] for call in MEASURED_CALLS_MS]
    aux = {str(shape): auxiliary_bytes(triton_module, *shape, paper_p_mix(shape[1])) for shape in shapes}
    peaks = {str(point["shape"]): peak_bytes(triton_module, *point["shape"], paper_p_mix(point["shape"][1]))
             for point in MEASURED_PEAK_MIB}  # fmt: skip
    Path(json_path).write_text(json.dumps(dict(analyses=[[list(k), v] for k, v in found.items()], aux=aux,
                                               peaks=peaks)))  # fmt: skip



# Where the AOT helper lived in a commit: the calibration commits predate tools/kernels/.
AOT_HELPER_PATHS = ("tools/kernels/triton_aot.py", "benchmarks/triton_aot.py")


def aot_helper_path(commit):
    """The path of triton_aot.py in a commit."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", commit, *AOT_HELPER_PATHS], check=True,
                            capture_output=True, text=True).stdout.split()  # fmt: skip
    return next(path for path in AOT_HELPER_PATHS if path in listed)


def commit_inputs(commit):
    """calibration_inputs of a commit's kernels, launched by its own launch builder (its backend's argument dtypes) and
    analysed by this tool: its files come first on the path."""
    helper = aot_helper_path(commit)
    with tempfile.TemporaryDirectory(prefix="gpu-time-model-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "modeling_plat", helper], check=True,
                                 capture_output=True)  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        out = Path(tmp) / "inputs.json"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(PYTHONPATH=os.pathsep.join([str(Path(tmp, helper).parent), tmp, str(Path(__file__).parent)]),
                   TRITON_CACHE_DIR=str(Path(tmp) / "cache"))  # fmt: skip
        subprocess.run([sys.executable, "-m", "gpu_time_model", "--calibration-inputs", str(out)], check=True, env=env,
                       cwd=tmp)  # fmt: skip
        inputs = json.loads(out.read_text())
    inputs["analyses"] = {tuple(k): v for k, v in inputs["analyses"]}
    return inputs


def calibrate():
    """Fit LATENCY_HIDING on every measured set's kernels and AUXILIARY_BANDWIDTH on CALIBRATION_COMMIT's profile;
    print predicted against measured."""
    inputs = {calibration["commit"]: commit_inputs(calibration["commit"]) for calibration in CALIBRATIONS}
    shape = CALIBRATION_SHAPE

    def predicted_us(calibration, point, ready):
        heads = shape["heads"]
        p = [point["p"][0]] * heads if len(point["p"]) == 1 else paper_p_mix(heads)  # one p, or the paper's mix
        kernels = predict(inputs[calibration["commit"]]["analyses"], (0, 0), shape["batch"], heads, shape["tokens"],
                          point["head_dim"], p, ready, grid=calibration["grid"])[2]  # fmt: skip
        return 1e6 * kernels[point["kernel"]]

    fitted = [(calibration, point) for calibration in CALIBRATIONS for point in calibration["kernels"]
              if not point.get("memory_bound")]  # fmt: skip
    candidates = [step / 1000 for step in range(20, 600)]
    ready = min(candidates, key=lambda r: sum(math.log(predicted_us(c, pt, r) / pt["us"]) ** 2 for c, pt in fitted))
    found = inputs[CALIBRATION_COMMIT]["analyses"]
    calibration_call = (shape["batch"], shape["heads"], shape["tokens"], MEASURED_AUXILIARY_US["head_dim"])
    aux_bytes = sum(inputs[CALIBRATION_COMMIT]["aux"][str(calibration_call)])
    bandwidth = aux_bytes / (MEASURED_AUXILIARY_US["us"] * 1e-6)
    print(f"fitted on {len(fitted)} kernel times of {len(CALIBRATIONS)} commits: LATENCY_HIDING = {ready:.3f}; "
          f"AUXILIARY_BANDWIDTH = {bandwidth:.3g} B/s ({aux_bytes / 1e6:.0f} MB in {MEASURED_AUXILIARY_US['us']} us, "
          f"{CALIBRATION_COMMIT})")  # fmt: skip
    print(f"{'commit':<8} {'kernel':<6} {'d':>4} {'p':<10} {'regs':>4} {'warps/sched':>11} {'clk/score':>9} "
          f"{'predicted us':>12} {'measured us':>11} {'error':>7}")  # fmt: skip
    for calibration in CALIBRATIONS:
        for point in calibration["kernels"]:
            analysis = inputs[calibration["commit"]]["analyses"][point["kernel"], point["head_dim"], point["p"][0]]
            _, warps = residency(analysis["registers"], analysis["config"]["num_warps"], analysis["shared"])
            value = predicted_us(calibration, point, ready)
            note = "  (memory bound: not fitted)" if point.get("memory_bound") else ""
            print(f"{calibration['commit']:<8} {point['kernel']:<6} {point['head_dim']:>4} "
                  f"{'/'.join(map(str, point['p'])):<10} {analysis['registers']:>4} {warps:>11.1f} "
                  f"{clocks_per_score(analysis, ready):>9.3f} {value:>12.0f} {point['us']:>11} "
                  f"{value / point['us'] - 1:>+7.0%}{note}")  # fmt: skip
    inputs = inputs[CALIBRATION_COMMIT]
    print("whole calls, paper mix (kernels + auxiliary operations; launches and host work not modelled):")
    for call in MEASURED_CALLS_MS:
        shape = call["shape"]
        predicted = predict(found, inputs["aux"][str(shape)], *shape, paper_p_mix(shape[1]), ready, bandwidth,
                            CALIBRATION_GRID)[:2]  # fmt: skip
        errors = [predicted[i] * 1e3 / call["ms"][i] - 1 for i in (0, 1)]
        print(f"  {str(shape):<20} forward {predicted[0] * 1e3:.3f} ms against {call['ms'][0]} ({errors[0]:+.0%}), "
              f"forward + backward {predicted[1] * 1e3:.3f} ms against {call['ms'][1]} ({errors[1]:+.0%})")
    print("peak memory of a forward + backward (allocations counted on CPU; no fitted constant):")
    for point in MEASURED_PEAK_MIB:
        predicted = inputs["peaks"][str(point["shape"])] / 2**20
        print(f"  {str(point['shape']):<20} {predicted:.1f} MiB against {point['plat']} "
              f"({predicted / point['plat'] - 1:+.1%})")
    return ready, bandwidth


def report_targets(compiled=False):
    """Today's kernels at the targets' shapes: predicted times and ratios to SDPA's measured ones; ``compiled``: the
    kernels as torch.compile compiles them (``as_torch_compile_builds``)."""
    from modeling_plat import plap_attention_triton as triton_module

    found = analyses(sorted({t["shape"][3] for t in TARGETS}), PAPER_MIX, compiled)
    print(f"predicted on sm_90 (H200 + H100 calibration: LATENCY_HIDING = {LATENCY_HIDING}, auxiliary operations at "
          f"{AUXILIARY_BANDWIDTH:.3g} B/s), bf16, causal, p mix {PAPER_MIX}, "
          f"{'as torch.compile compiles the kernels' if compiled else 'as the eager launches compile the kernels'}")
    for (kernel, head_dim, p), analysis in sorted(found.items(), key=lambda item: (item[0][1], item[0][0])):
        blocks, warps = residency(analysis["registers"], analysis["config"]["num_warps"], analysis["shared"])
        config = analysis["config"]
        print(f"  d={head_dim:<4} {kernel:<5} p={p:<4} tiles {config['block_m']}x{config['block_n']}, "
              f"{config['num_warps']} warps, {analysis['registers']} registers, {blocks} block(s)/SM = {warps:.0f} "
              f"warps/scheduler, issuing {issue_fraction(warps):.0%}, {clocks_per_score(analysis):.3f} clk/score "
              f"({analysis['per_score']['instructions']:.1f} instructions)")  # fmt: skip
    print("  the kernels' first passes and the auxiliary operations alone: no host latency, no exact passes (on an H100 "
          "they added 340 us to the 4k forward, 470 us to its forward + backward)")  # fmt: skip
    rows = []
    for target in TARGETS:
        batch, heads, tokens, head_dim = target["shape"]
        p = paper_p_mix(heads)
        aux = auxiliary_bytes(triton_module, batch, heads, tokens, head_dim, p)
        forward, both, kernels = predict(found, aux, batch, heads, tokens, head_dim, p)
        ratios = (forward * 1e3 / target["sdpa_ms"][0], both * 1e3 / target["sdpa_ms"][1])
        verdicts = [_verdict(ratio, goal) for ratio, goal in zip(ratios, target["target"])]
        peak_mib = peak_bytes(triton_module, batch, heads, tokens, head_dim, p) / 2**20
        memory = f"peak memory {peak_mib:.1f} MiB"
        if target["sdpa_peak_mib"]:
            memory += (f" = {peak_mib / target['sdpa_peak_mib']:.2f}x SDPA "
                       f"{_verdict(peak_mib / target['sdpa_peak_mib'], PEAK_MEMORY_TARGET)}")  # fmt: skip
        print(f"  {target['shape']}: forward {forward * 1e3:.3f} ms = {ratios[0]:.2f}x SDPA {verdicts[0]}; forward + "
              f"backward {both * 1e3:.3f} ms = {ratios[1]:.2f}x SDPA {verdicts[1]} (kernels fwd "
              f"{kernels['fwd'] * 1e6:.0f}, dkdv {kernels['dkdv'] * 1e6:.0f}, dq {kernels['dq'] * 1e6:.0f} us; "
              f"auxiliary {aux[0] / 1e6:.0f} + {aux[1] / 1e6:.0f} MB); {memory}")  # fmt: skip
        rows.append(dict(shape=target["shape"], forward_ms=forward * 1e3, both_ms=both * 1e3, ratios=ratios,
                         peak_mib=peak_mib))  # fmt: skip
    return rows


def _verdict(ratio, goal):
    return "" if goal is None else ("meets" if ratio <= goal else "misses") + f" <= {goal}x"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="refit on the measured kernels (CALIBRATIONS)")
    parser.add_argument("--calibration-inputs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--as-compiled", action="store_true",
                        help="also predict the kernels as torch.compile compiles them, against the eager ones")
    parser.add_argument("--json", type=Path, help="write the predictions to this file")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("TRITON_INTERPRET is set: the kernels are interpreted functions and cannot be compiled")
    if args.calibration_inputs:
        return calibration_inputs(args.calibration_inputs)
    if args.calibrate:
        calibrate()
        return 0
    rows = report_targets()
    record = dict(latency_hiding=LATENCY_HIDING, bandwidth=AUXILIARY_BANDWIDTH, rows=rows)
    if args.as_compiled:
        record["compiled_rows"] = report_targets(compiled=True)
        print("as torch.compile compiles the kernels, against the eager launches:")
        for eager, compiled in zip(rows, record["compiled_rows"]):
            print(f"  {eager['shape']}: forward {compiled['forward_ms'] / eager['forward_ms']:.2f}x, "
                  f"forward + backward {compiled['both_ms'] / eager['both_ms']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
