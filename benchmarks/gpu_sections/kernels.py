"""The kernels section: the GPU kernels of one plap_attention forward + backward by name and launch, and the host
time of the call, in all, in its Triton launches and by function."""

import collections
import contextlib
import cProfile
import functools
import importlib
import platform
import pstats
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from modeling_plat import paper_p_mix
from modeling_plat.plap_dispatch import plap_attention

from .attention import ATTENTION_SHAPES, ENVELOPE_SHAPES, KERNEL_SPEED_SHAPES
from .measure import ROOT, backend_spy, bf16_attention_inputs, error_fields, no_log, synchronize

# Functions a kernels row's host profile keeps, by own time.
HOST_PROFILE_TOP = 30


class KernelCase(NamedTuple):
    """A kernels row's inputs: (batch, heads, length, head size, causal), p of every head (None: the paper's mix),
    and its values: "random", or "tokens" (``token_values``)."""

    shape: tuple
    p: float | None = None
    values: str = "random"


KERNEL_CASES = {
    **{name: KernelCase(ATTENTION_SHAPES[name]) for name in ("paper-lm", *KERNEL_SPEED_SHAPES)},
    "4k-p1.5": KernelCase(ATTENTION_SHAPES["4k"], 1.5),
    # Random values have no close pairs: their exact passes leave at once. Here most blocks take them.
    "4k-tokens": KernelCase(ATTENTION_SHAPES["4k"], values="tokens"),
    "d256-4k": KernelCase((*ENVELOPE_SHAPES["d256-4k"][:4], True)),  # the envelope's causal rows
}
# The vocabulary of the token-like values: Penn Treebank's size.
TOKEN_VOCABULARY = 10_000


def token_values(batch, heads, length, head_dim, device, generator):
    """bfloat16 values (B, H, N, d) that repeat as a text's tokens do where a layer's values depend on its token alone
    (the first layer of a model whose positions rotate only queries and keys, as RoPE does): a random vector per token
    of the vocabulary and head, the tokens drawn by Zipf's law (frequencies as 1 / rank), so that most query blocks
    hold a query whose value equals an earlier key's, a pair the exact passes take."""
    from bench_train_step import zipf_tokens

    tokens = zipf_tokens(batch, length, TOKEN_VOCABULARY, generator, device)
    table = torch.randn(heads, TOKEN_VOCABULARY, head_dim, generator=generator, device=device, dtype=torch.bfloat16)
    return table[:, tokens].transpose(0, 1).contiguous()


def uncapped(config):
    """The configuration without the first passes' register caps (``KernelConfig.max_registers``), as Inductor launches
    the kernels."""
    return type(config)(*(kernel._replace(max_registers=0) for kernel in config))


def wide_256(config):
    """Head size 256 with larger tiles whose first passes spill nothing inside their loops on sm_90
    (tools/kernels/README.md, "Larger tiles at head size 256"): the forward's and dQ's blocks of 32 queries rather than
    16, which load each key tile for twice as many scores (dQ's with 8 warps rather than 4), and dK/dV's query tiles of
    64 rather than 32 (a third fewer instructions per score; 144 KB of shared memory)."""
    return config._replace(fwd=config.fwd._replace(block_m=32), dkdv=config.dkdv._replace(block_m=64),
                           dq=config.dq._replace(block_m=32, num_warps=8))


def split_256(config):
    """``wide_256``'s forward and dQ, and dK/dV's first pass on blocks of 32 keys against query tiles of 32, which
    load each query tile for twice as many scores as blocks of 16 (about 48 bytes per score rather than 96) and spill
    nothing inside its loop on sm_90; its exact pass, which spills at 32 keys, on blocks of 16
    (``KernelConfig.exact_block``: the adopted tiles)."""
    return wide_256(config)._replace(dkdv=config.dkdv._replace(block_n=32, exact_block=16))


# Launch configurations measured again beside the adopted ones, rows named ``<case>-<variant>``: variant -> (the cases,
# how it changes their LaunchConfig). Compiled at 2k on an H200, dK/dV ran 10% faster uncapped
# (benchmarks/results/README.md); head size 256 ran at 6.4x SDPA's forward + backward there, its 16-row blocks loading
# 64 bytes per score.
CONFIG_VARIANTS = {"uncapped": (("4k", "16k"), uncapped), "wide": (("d256-4k",), wide_256),
                   "split": (("d256-4k",), split_256)}


def device_events(call, device, repeats):
    """(name, microseconds) of each kernel that ``repeats`` calls of call() run on ``device``, in launch order, from
    torch.profiler (on a CPU: its operators, nested ones included), after one call that builds and caches what the
    first call compiles."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()
    synchronize(device)
    activity, kind = (ProfilerActivity.CUDA, DeviceType.CUDA) if device.type == "cuda" else (ProfilerActivity.CPU,
                                                                                            DeviceType.CPU)
    with profile(activities=[activity]) as prof:
        for _ in range(repeats):
            call()
        synchronize(device)
    return [(event.name, event.time_range.elapsed_us())
            for event in sorted(prof.events(), key=lambda event: event.time_range.start) if event.device_type == kind]


def kernel_times(call, device, repeats):
    """{name: launches per call, microseconds per call, median microseconds of each launch in launch order} of the
    kernels that call() runs on ``device`` (``device_events``)."""
    durations = collections.defaultdict(list)
    for name, microseconds in device_events(call, device, repeats):
        durations[name].append(microseconds)
    kernels = {}
    for name, times in durations.items():
        launches = len(times) // repeats
        if launches * repeats != len(times):  # not launched the same number of times by every call
            raise RuntimeError(f"{name} ran {len(times)} times in {repeats} calls")
        kernels[name] = dict(launches=launches, us=sum(times) / repeats,
                             launch_us=[statistics.median(times[i::launches]) for i in range(launches)])  # fmt: skip
    return kernels


def device_work(call, device, repeats):
    """The kernels that one call() runs on ``device`` in all (``device_events``, averaged over ``repeats`` calls): how
    many, and their microseconds."""
    events = device_events(call, device, repeats)
    return dict(kernels=len(events) / repeats, kernel_us=sum(microseconds for _, microseconds in events) / repeats)


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


def launch_costs(call, device, rounds, count):
    """Host microseconds per launch of call()'s first Triton launch (its forward's first kernel; call() must launch
    one), ``count`` times back to back, the median of ``rounds`` rounds in rotated order, through:
    - ``plat``: the backend's launch (``_run``: the plan's key, the bound kernel's lookup, Triton's launcher);
    - ``plat_python``: the same with the compiled kernel's launcher a no-op: the Python of the backend alone;
    - ``compiled_run``: the compiled kernel's launcher alone, the arguments ready (Triton's launcher and the driver);
    - ``c_launcher``: the C function that launcher calls (Triton 3.6, where it is checked, and a kernel with no
      scratch memory): a launch without Python, the floor of any launch through Triton;
    - ``triton_jit``: Triton's own launch, ``kernel[grid](*args, **meta)`` (its binder and cache lookup);
    - ``aten_launch`` and ``aten_empty``: one ATen kernel (``zero_`` of one element) and one allocation on ``device``,
      what the host takes for PyTorch's own launches.
    The bound variants need a GPU (the Triton interpreter binds nothing): on a CPU only ``plat``, ``triton_jit`` and
    the ATen ones are measured."""
    triton_module = importlib.import_module("modeling_plat.plap_attention_triton")
    original, recorded = triton_module._run, []

    def recording_run(launch, query, value):
        recorded.append((launch, query, value))
        return original(launch, query, value)

    triton_module._run = recording_run
    try:
        call()
    finally:
        triton_module._run = original
    synchronize(device)
    launch, query, value = recorded[0]
    scratch = torch.zeros(1, device=device)
    variants = dict(plat=lambda: original(launch, query, value),
                    triton_jit=lambda: launch.kernel[launch.grid](*launch.args, **launch.meta),
                    aten_launch=scratch.zero_, aten_empty=lambda: torch.empty(1, device=device))  # fmt: skip
    pointers = [tensor.data_ptr() for tensor in launch.args[: launch.tensors]]
    table, entry = triton_module._BOUND.compiled, None
    if device.type == "cuda":
        key = importlib.import_module("modeling_plat.triton_launcher").launch_key(launch, pointers,
                                                                                  torch.cuda.current_device())
        entry = table.get(key)
    if entry is not None:
        compiled, constexprs = entry
        grid = (*launch.grid, 1, 1)[:3]
        stream = triton_module.triton.runtime.driver.active.get_current_stream(torch.cuda.current_device())
        arguments = (*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *pointers,
                     *launch.args[launch.tensors :], *constexprs)  # fmt: skip
        variants.update(compiled_run=lambda: compiled.run(*arguments), plat_python=variants["plat"])
        launcher = compiled.run
        if _checked_c_launcher(launcher):
            c_arguments = (*arguments[:5], launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                           *arguments[5:])  # fmt: skip
            variants["c_launcher"] = lambda: launcher.launch(*c_arguments)
    names, times = list(variants), collections.defaultdict(list)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            if name == "plat_python":
                table[key] = (_NoRun(compiled), constexprs)
            try:
                synchronize(device)
                start = time.perf_counter()
                for _ in range(count):
                    variants[name]()
                times[name].append((time.perf_counter() - start) / count * 1e6)
            finally:
                if name == "plat_python":
                    table[key] = entry
    synchronize(device)
    return {name: statistics.median(times[name]) for name in names}


def _checked_c_launcher(launcher):
    """Whether ``launcher`` (a compiled kernel's ``run``) is Triton 3.6's CUDA launcher, whose C function takes the
    grid, stream, function, cooperative and PDL flags, both scratch buffers, then what ``run`` takes after the function,
    and the kernel needs no scratch memory."""
    import triton

    return (triton.__version__.startswith("3.6.") and type(launcher).__name__ == "CudaLauncher"
            and not launcher.global_scratch_size and not launcher.profile_scratch_size)  # fmt: skip


@contextlib.contextmanager
def changed_launch_configs(change):
    """The Triton backend's launch configurations as ``change(config)`` makes them, while inside."""
    triton_module = importlib.import_module("modeling_plat.plap_attention_triton")
    adopted = triton_module.launch_config

    def changed(*args):
        config = adopted(*args)
        return None if config is None else change(config)

    triton_module.launch_config = changed
    triton_module._kernel_arguments.cache_clear()  # the configurations calls have taken so far
    try:
        yield
    finally:
        triton_module.launch_config = adopted
        triton_module._kernel_arguments.cache_clear()


class _NoRun:
    """A compiled kernel whose launcher does nothing."""

    def __init__(self, compiled):
        self.function, self.packed_metadata = compiled.function, compiled.packed_metadata

    def run(self, *arguments):
        pass


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


def kernel_runs(cases=KERNEL_CASES, variants=CONFIG_VARIANTS):
    """(name, case, variant) of each row of the kernels section: ``cases`` (variant None), then each of ``variants``'
    cases again with its configurations (``<case>-<variant>``, variant its (name, change) in ``variants``)."""
    adopted = [(name, case, None) for name, case in cases.items()]
    return adopted + [(f"{name}-{variant}", cases[name], (variant, change))
                      for variant, (names, change) in variants.items() for name in names]  # fmt: skip


def launch_config_fields(head_dim, device):
    """{kernel: its KernelConfig's fields} that bfloat16 inputs of this head size launch with on the GPU ``device``;
    None on a CPU, where the interpreter's tiles run."""
    if device.type != "cuda":
        return None
    triton_module = importlib.import_module("modeling_plat.plap_attention_triton")
    config = triton_module.launch_config(torch.bfloat16, head_dim, head_dim, torch.cuda.get_device_capability(device))
    return None if config is None else {kernel: fields._asdict() for kernel, fields in config._asdict().items()}


def kernels_row(name, case, variant, device, log, repeats, launch_rounds=0, launch_count=0):
    """A case's row, with the launch configurations of ``variant`` ((name, change), ``CONFIG_VARIANTS``) where given:
    its kernels, its host time and host profile; with ``launch_rounds``, also the host cost of one of its launches by
    the ways of launching it (``launch_costs``)."""
    (batch, heads, length, head_dim, causal), p, values = case
    q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
    if values == "tokens":
        generator = torch.Generator(device=device).manual_seed(1)
        v = token_values(batch, heads, length, head_dim, device, generator).requires_grad_()
    p_heads = tuple(paper_p_mix(heads)) if p is None else (p,) * heads
    row = dict(name=name, batch=batch, heads=heads, length=length, head_dim=head_dim, causal=causal,
               p=sorted(set(p_heads)), values=values)  # fmt: skip

    def call():
        torch.autograd.grad(plap_attention(q, k, v, p_heads, is_causal=causal), (q, k, v), grad_out)

    if variant is not None:
        row["variant"] = variant[0]
    try:
        # Host times before the profiler session: measured after it (6d6cd30's record), a paper-LM call's host
        # work read 1.73 ms where the attention section's whole synchronised call took 1.33.
        configs = changed_launch_configs(variant[1]) if variant is not None else contextlib.nullcontext()
        with backend_spy() as chosen, configs:
            row["config"] = launch_config_fields(head_dim, device)
            row["host"] = host_times(call, device, repeats)
            row["host_profile"] = host_profile(call, device, repeats)
            row["kernels"] = kernel_times(call, device, repeats)
        row["backends"] = dict(chosen)
        if launch_rounds and row["host"]["launches"]:
            row["launch_costs"] = launch_costs(call, device, launch_rounds, launch_count)
            log(f"kernels {name}: host us per launch, " + ", ".join(f"{way} {us:.1f}" for way, us
                                                                    in row["launch_costs"].items()))  # fmt: skip
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
    return row


def kernels_section(device, log, cases=KERNEL_CASES, repeats=5, launch_rounds=7, launch_count=50,
                    variants=CONFIG_VARIANTS):  # fmt: skip
    """A row per case (``kernels_row``), the first's also with the host cost of one launch by each way of launching
    it; then the ``variants``' cases again with their configurations (``kernel_runs``)."""
    rows = []
    for index, (name, case, variant) in enumerate(kernel_runs(cases, variants)):
        costs = (launch_rounds, launch_count) if index == 0 else (0, 0)
        rows.append(kernels_row(name, case, variant, device, log, repeats, *costs))
    for row in rows:
        if against_adopted(row, rows):
            log(f"kernels {row['name']} against the adopted configurations: " + ", ".join(
                f"{kernel} {ratio:.2f}x" for kernel, ratio in row["to_adopted"].items()))  # fmt: skip
    return rows


def against_adopted(row, rows):
    """Whether ``row`` is a variant's row whose case's adopted row is among ``rows`` (named as ``kernel_runs`` names
    them), both with their kernels timed; if so, its ``to_adopted``: each kernel's time and the total over the adopted
    row's (``total``)."""
    if "variant" not in row or "kernels" not in row:
        return False
    adopted = next((other for other in rows if other["name"] == row["name"].removesuffix(f"-{row['variant']}")), {})
    if "kernels" not in adopted:
        return False
    row["to_adopted"] = {kernel: times["us"] / adopted["kernels"][kernel]["us"]
                         for kernel, times in row["kernels"].items() if kernel in adopted["kernels"]}  # fmt: skip
    row["to_adopted"]["total"] = row["total_us"] / adopted["total_us"]
    return True


def kernels_jobs(device, cases=KERNEL_CASES, variants=CONFIG_VARIANTS):
    """The kernels section's rows, each run once untimed: precompilation's jobs (``precompile``)."""
    return [(f"kernels {name}", functools.partial(kernels_row, name, case, variant, device, no_log, 1))
            for name, case, variant in kernel_runs(cases, variants)]  # fmt: skip
