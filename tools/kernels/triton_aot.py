"""Compile the fused Triton kernels ahead of time for NVIDIA GPUs, on a machine without one.

Each case is one input configuration (architecture, dtype, head sizes, mask and formulation flags). Its
kernels are built with the launch functions of ``plap_attention_triton`` on small CPU tensors, so that the
arguments, their specialisation (alignment, strides of 1) and the launch configuration are those of a real
launch, and compiled by ``triton.compile`` for ``GPUTarget("cuda", arch, 32)``: Triton's own front end, the
NVIDIA backend and the ``ptxas`` shipped in its wheel. No GPU or driver is involved.

The interpreter (TRITON_INTERPRET=1, set by the tests on CPU) replaces the kernels by interpreted
functions, so compilation runs in child processes without it: a ``Compilation`` starts

    python tools/kernels/triton_aot.py <queue folder>

each of which takes cases from the queue until none is left and prints one JSON line per kernel: shared memory bytes,
registers and spills (from ``ptxas -v``), compile seconds and the Triton version, or the error, and for each launch the
tensors that torch.compile takes as written by it (``written_arguments``).

The children import the installed Triton, or the one in the folder that ``PLAT_AOT_TRITON`` names (a
``pip install --no-deps --target`` of another version): a GPU runs the Triton its torch pins, not necessarily this
machine's (tools/kernels/README.md).
"""

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Names a folder holding another Triton than the installed one, which the compile children import first.
TRITON_FOLDER_VARIABLE = "PLAT_AOT_TRITON"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Each attention kernel's first pass (the distances' expansion alone), and its exact pass (close pairs by direct
# differences), or that pass alone (a case's ``alone``), as <name>_exact.
KERNELS = ("fwd", "fwd_exact", "dq", "dq_exact", "dkdv", "dkdv_exact")


def case_kernels(case):
    """The kernels compiled for a case: ``kernels`` if it names some, else all."""
    return tuple(case.get("kernels", KERNELS))
DEFAULT_P = 1.5  # the paper's p < 2; the paper's mix (1.5 and 2.5) compiles the same power, any other p another
HEADS = 3  # of the small inputs a case is compiled for


def case_p(case):
    """The heads' p of a case: ``p`` is one float for every head, or a list of one per head."""
    p = case.get("p", DEFAULT_P)
    return tuple(p) if isinstance(p, (list, tuple)) else (p,) * HEADS


def case_id(case):
    flags = "".join(name for name, on in (("causal-", case["is_causal"]), ("padding-", case["key_mask"]),
                                          ("packed-", case.get("documents"))) if on)  # fmt: skip
    window = f"window{case['window']}-" if case.get("window") else ""
    window += "float64-scalars-" if case.get("float64_scalars") else ""
    window += "alone-" if case.get("alone") else ""
    window += "tokens-major-" if case.get("tokens_major") else ""
    window += f"{case['variant']}-" if case.get("variant") else ""
    return (
        f"sm{case['arch']}-{case['dtype']}-d{case['head_dim']}-dv{case['value_dim']}-{flags}{window}"
        f"{'euler' if case['euler'] else 'paper'}-p{'+'.join(f'{p:g}' for p in sorted(set(case_p(case))))}"
        f"-nq{case['num_queries']}"
        f"-nk{case['num_keys']}"
    )


def launches(triton_module, case):
    """The (name, Launch) of the kernels for a case, with their arguments as a real call makes them
    (``forward_plan``, ``backward_plan``), on CPU tensors shaped as a small real input: three heads with the case's p
    (at most two values: the paper's two are a launch each, under the same name, or one launch of the exact pass alone
    where a case sets ``alone``, as small calls run it); ``window``, when a case gives one, is a causal sliding
    window's size; ``tokens_major``: q, k and v as a model's projections give them, (B, N, H, d) viewed as (B, H, N, d)
    (row strides H * d, compile-time constants of the kernels)."""
    batch, heads = 2, HEADS
    dtype = DTYPES[case["dtype"]]
    nq, nk, d, dv = case["num_queries"], case["num_keys"], case["head_dim"], case["value_dim"]

    def rows(length, size):
        if case.get("tokens_major"):
            return torch.zeros(batch, length, heads, size, dtype=dtype).transpose(1, 2)
        return torch.zeros(batch, heads, length, size, dtype=dtype)

    query, key, value = rows(nq, d), rows(nk, d), rows(nk, dv)
    key_keep = torch.ones(batch, nk, dtype=torch.int8) if case["key_mask"] else None
    documents = torch.zeros(batch, nk, 3, dtype=torch.int32) if case.get("documents") else None
    config = case_config(triton_module, case)
    flags = (case_p(case), case["is_causal"], case.get("window", 0), 1e-6, case["euler"], config,
             case.get("alone", False))  # fmt: skip
    outputs, forward = triton_module.forward_plan(query, key, value, key_keep, documents, *flags)
    grad_out = torch.zeros_like(outputs[0])
    _, backward = triton_module.backward_plan(grad_out, query, key, value, key_keep, documents, *outputs, *flags)
    return [(kernel_name(triton_module, launch), launch) for launch in (*forward, *backward)]


def case_config(triton_module, case):
    """The LaunchConfig a case compiles: its ``config`` (each kernel's KernelConfig fields, as lists) where it names
    one, a configuration measured beside the adopted ones (its ``variant``), else the adopted one of its GPU."""
    if "config" in case:
        kernel_config = triton_module.KernelConfig
        return triton_module.LaunchConfig(*(kernel_config(*fields) for fields in case["config"]))
    capability = (case["arch"] // 10, case["arch"] % 10)
    return triton_module.launch_config(DTYPES[case["dtype"]], case["head_dim"], case["value_dim"], capability)


def kernel_name(triton_module, launch):
    """The KERNELS entry of a launch: its kernel, and whether it is an exact pass."""
    kernel = {triton_module.plap_forward_kernel: "fwd", triton_module.plap_dq_kernel: "dq",
              triton_module.plap_dkdv_kernel: "dkdv"}[launch.kernel]  # fmt: skip
    return kernel + ("_exact" if launch.meta["PASS"] != int(triton_module.FIRST_PASS) else "")


def _compile(launch, arch, float64_scalars=False):
    """triton.compile of a launch for an sm_<arch> target, specialised as JITFunction.run would, or with its float
    arguments typed float64 (``float64_scalars``) as Inductor's launcher may type Python floats under torch.compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.meta)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    if float64_scalars:
        signature = {name: "fp64" if kind == "fp32" else kind for name, kind in signature.items()}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptxas_usage(log):
    """Registers and spill bytes from the ``ptxas -v`` log that Triton prints with TRITON_DUMP_PTXAS_LOG=1."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(
        registers=int(registers.group(1)) if registers else None,
        spill_stores=int(spills.group(1)) if spills else None,
        spill_loads=int(spills.group(2)) if spills else None,
    )


def compile_with_log(launch, arch, float64_scalars=False):
    """(compiled kernel, ptxas log): the log holds registers, spills and warnings when TRITON_DUMP_PTXAS_LOG=1
    is set and the kernel is not found in Triton's cache."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = _compile(launch, arch, float64_scalars)
    return compiled, log.getvalue()


class _StandInDriver:
    """Answers torch's question for the GPU that a kernel is analysed for (``written_arguments``): sm_<arch>."""

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target


class _AnalysisFailure(logging.Handler):
    """Catches the warning with which torch's analysis of a kernel gives up (and takes every tensor as written)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.failed = None

    def emit(self, record):
        self.failed = record.getMessage()


@contextlib.contextmanager
def torch_analysis_for(arch):
    """A context in which torch's analysis of the Triton kernels that torch.compile traces (which tensors each launch
    writes) compiles them for sm_<arch>, with no GPU or driver: it yields the handler that catches the warning with
    which the analysis gives up, if it does."""
    import triton
    from torch._higher_order_ops import triton_kernel_wrap

    failure, logger = _AnalysisFailure(), logging.getLogger(triton_kernel_wrap.__name__)
    driver, previous = triton.runtime.driver, triton.runtime.driver._active
    driver.set_active(_StandInDriver(arch))
    logger.addHandler(failure)
    try:
        yield failure
    finally:
        logger.removeHandler(failure)
        driver._active = previous  # as it was: its ``active`` would create the CUDA driver


def written_arguments(launch, arch):
    """(written, overlaps): the names of the tensor arguments that torch.compile takes as written by a launch, and the
    pairs (written, other) of its tensor arguments that share memory (one storage, overlapping or not). ``written``
    comes from torch's own analysis of the kernel's TTIR for sm_<arch> (``identify_accessed_tensors``), with the
    arguments of the launch that torch.compile traces (``triton_launcher.traced_launch``); the functionalization of a
    traced launch clones each written tensor, runs the kernel on the clones and copies each one back into its storage,
    so that an overlap loses what the kernel wrote, and views of one storage written by successive launches are not
    kept apart (torch's own note in its functionalization of kernel launches; measured on an H200 with torch 2.11:
    with euler's logsumexp and own weights two views of one tensor, a compiled call at 2k tokens gave a wrong dV).
    ``written`` is None where the analysis failed: torch then takes every tensor as written."""
    from torch._higher_order_ops import triton_kernel_wrap

    from modeling_plat.triton_launcher import UNTRACED_OPTIONS

    names = launch.kernel.arg_names
    tensors = dict(zip(names, launch.args[: launch.tensors]))
    kwargs = dict(zip(names, launch.args))
    kwargs.update((name, value) for name, value in launch.meta.items() if name not in UNTRACED_OPTIONS)
    with torch_analysis_for(arch) as failure:
        accesses = triton_kernel_wrap.identify_accessed_tensors(launch.kernel, kwargs, {})
    written = sorted(dep.name for dep in accesses.read_writes.writes if dep.name in tensors)
    overlaps = [(name, other) for name in written for other in tensors
                if other != name and _one_storage(tensors[name], tensors[other])]  # fmt: skip
    return (None if failure.failed else written), overlaps


def _one_storage(first, second):
    """Whether two tensors are views of one storage (empty ones, never read nor written, aside)."""
    if first.numel() == 0 or second.numel() == 0:
        return False
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def compile_case(triton_module, case):
    """One result dict per kernel of the case: where its heads make several launches of a kernel pass
    (``plap_attention_triton.launch_groups``), their largest shared memory, registers and spills (each launch's in
    ``launches``), or the first error."""
    results = {}
    for name, launch in launches(triton_module, case):
        if name not in case_kernels(case):
            continue
        result = results.setdefault(name, dict(case=case_id(case), kernel=name, arch=case["arch"], ok=True,
                                               triton=triton_version(), seconds=0.0, launches=[]))  # fmt: skip
        start = time.perf_counter()
        try:
            compiled, log = compile_with_log(launch, case["arch"], case.get("float64_scalars", False))
            usage = dict(shared=compiled.metadata.shared, **ptxas_usage(log))
            written, overlaps = written_arguments(launch, case["arch"])
            result["launches"].append(dict(meta=launch.meta, written=written, overlaps=overlaps, **usage))
            for field, value in usage.items():
                result[field] = max(result.get(field) or 0, value or 0) if value is not None else result.get(field)
        except Exception as error:  # reported to the test, which fails on it
            message = f"{type(error).__name__}: {error}"
            if result["ok"]:
                result.update(ok=False, meta=launch.meta, error=message[-4000:], trace=traceback.format_exc()[-4000:])
        result["seconds"] = round(result["seconds"] + time.perf_counter() - start, 2)
    return list(results.values())


def triton_version():
    import triton

    return f"{triton.__version__} ({Path(triton.__file__).parent})"


def child_environment(cache_dir):
    """The compile children's environment: no interpreter, a fresh cache, ptxas' log, this checkout's modeling_plat
    (not an installed copy, such as an editable install of another worktree) and the Triton of ``PLAT_AOT_TRITON``
    first on the path where it names one."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), TRITON_DUMP_PTXAS_LOG="1")
    paths = [str(ROOT), env.get("PYTHONPATH")]
    folder = os.environ.get(TRITON_FOLDER_VARIABLE)
    if folder:
        if not (Path(folder) / "triton" / "__init__.py").is_file():  # else the installed Triton would answer
            raise FileNotFoundError(f"{TRITON_FOLDER_VARIABLE}={folder} holds no triton package")
        paths.insert(0, folder)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def usable_cores():
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class Compilation:
    """Cases compiling in child processes without the interpreter, started at once; ``results()`` waits for them.

    ``cache_dir`` should be new and empty: a kernel found in Triton's cache would not be compiled again. The cases wait
    in a queue of files there, one file a case, which the children take one at a time (``take_cases``): ``processes``
    children (compilation is single-threaded) at first, by default one per CPU core this process may use, and as many
    as those cores while ``results()`` waits, since the caller then leaves its own core to them.
    """

    def __init__(self, cases, cache_dir, processes=None, seconds_per_case=60):
        self.env = child_environment(cache_dir)
        self.queue = queue_cases(Path(cache_dir) / "queue", cases)
        self.children = []
        processes = min(processes or usable_cores(), len(cases))
        self.deadline = time.monotonic() + 30 + seconds_per_case * -(-len(cases) // max(processes, 1))
        try:
            self._start(processes)
        except BaseException:
            self.close()
            raise

    def _start(self, processes):
        """Children up to ``processes`` of them running, as long as cases wait."""
        running = sum(child.poll() is None for _, child in self.children)
        for _ in range(min(processes - running, len(list(self.queue.glob("*.json"))))):
            output = self.queue / f"child-{len(self.children)}"
            # Files, not pipes: a child whose pipe filled would wait until the children before it had finished.
            with open(output.with_suffix(".out"), "w") as out, open(output.with_suffix(".err"), "w") as err:
                child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(self.queue)], stdout=out,
                                         stderr=err, env=self.env, cwd=ROOT)  # fmt: skip
            self.children.append((output, child))

    def results(self):
        """The result dicts of every case's kernels."""
        try:
            self._start(usable_cores())
            results = []
            for output, child in self.children:
                child.wait(timeout=max(self.deadline - time.monotonic(), 1))
                if child.returncode != 0:
                    stderr = output.with_suffix(".err").read_text()
                    raise RuntimeError(f"the compile process failed ({child.returncode}):\n{stderr[-4000:]}")
                results += [json.loads(line) for line in output.with_suffix(".out").read_text().splitlines()
                            if line.startswith("{")]  # fmt: skip
            return results
        finally:
            self.close()

    def close(self):
        """Stop the children still running."""
        for _, child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()


def queue_cases(queue, cases):
    """A new queue folder holding ``cases`` in their order, one JSON file a case, for ``take_cases``."""
    (queue / "taken").mkdir(parents=True)
    for index, case in enumerate(cases):
        (queue / f"{index:05d}.json").write_text(json.dumps(case))
    return queue


def take_cases(queue):
    """The cases of a Compilation's queue (a folder of one JSON file a case), each taken by moving its file to
    ``taken/``: a move that only one of the processes taking from the queue can make."""
    for path in sorted(queue.glob("*.json")):
        try:
            path.rename(queue / "taken" / path.name)
        except FileNotFoundError:  # another child took it
            continue
        yield json.loads((queue / "taken" / path.name).read_text())


def main():
    from modeling_plat import plap_attention_triton as triton_module

    if triton_module.INTERPRETED:
        sys.exit("TRITON_INTERPRET is set: the kernels are interpreted functions and cannot be compiled")
    for case in take_cases(Path(sys.argv[1])):
        for result in compile_case(triton_module, case):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
