"""How the fused kernels are launched: through what Triton compiled, bound once per specialization.

Triton's own launch, ``kernel[grid](*args, **meta)``, binds the arguments to the kernel's signature, specializes each
(alignment, integers equal to 1 or divisible by 16), builds a cache key, checks the globals the kernel reads and
calls the launch hooks, at every launch: 70-120 us of host time per launch on the H100 and H200 hosts measured here,
which attention at small shapes waits for. ``BoundLaunches`` keeps each compiled kernel under a key that holds
everything Triton specializes on, and more: the launch's plan (the kernel, its grid, its constexprs and options and
the values of its other non-tensor arguments, ``PlanKey``), the device, and for each tensor argument its dtype and
its address modulo 16 (which tells Triton's only specialization of a pointer). Equal keys thus mean equal
specializations: a repeated launch calls the compiled kernel's launcher directly. The first launch of a key goes
through Triton (which compiles or finds the kernel), and so does every launch while a profiler's launch hooks are set,
or on a Triton version whose launcher this module was not checked against.

While torch.compile traces the fused ops, their launches go through ``torch.library.wrap_triton`` instead, so that
Inductor sees the kernels and launches them itself (in CUDA graphs under ``mode="reduce-overhead"``). Under the Triton
interpreter (CPU tests) kernels run as plain functions.

Triton launches on CUDA's current device, with its current stream, whatever device the arguments are on; eager calls
run their launches on the inputs' GPU (``on_device``), as Inductor's code does for the kernels it launches.
"""

import contextlib
import itertools
import operator

import torch

from .triton_tiles import INTERPRETED, triton

TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2]) if triton is not None else None
# Triton versions whose compiled kernels' launcher (``CompiledKernel.run`` with its function, packed metadata, launch
# metadata and hooks before the arguments, constexprs included) was checked; others launch through Triton.
BOUND_LAUNCH_VERSIONS = ((3, 5), (3, 9))
# Compiled kernels kept: a model's layers launch a few per shape, each distinct length adds some.
MAX_BOUND = 4096
_DATA_PTR, _DTYPE = torch.Tensor.data_ptr, operator.attrgetter("dtype")
_SIXTEENS = itertools.repeat(16)


class PlanKey:
    """What a launch's plan fixes, as a key hashed once: ``value`` is a tuple of the kernel, grid, scalar arguments
    and meta items. A plan cached for a shape hands its key to every call, which a dict then finds by identity."""

    __slots__ = ("value", "hash")

    def __init__(self, value):
        self.value, self.hash = value, hash(value)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return isinstance(other, PlanKey) and self.value == other.value


class BoundLaunches:
    """Compiled kernels by everything Triton specializes their launches on (the module's docstring); ``__call__``
    launches one."""

    def __init__(self):
        self.compiled = {}
        self.current_stream = None  # Triton's own query of the current stream, resolved at the first launch
        self.enabled = (triton is not None and not INTERPRETED
                        and BOUND_LAUNCH_VERSIONS[0] <= TRITON_VERSION <= BOUND_LAUNCH_VERSIONS[1])  # fmt: skip

    def __call__(self, launch):
        if not self.enabled or launch.plan is None or _hooks_set():
            launch.kernel[launch.grid](*launch.args, **launch.meta)
            return
        # Tensors pass as their addresses: the launcher then neither asks them nor the driver for their pointers.
        pointers = list(map(_DATA_PTR, launch.args[: launch.tensors]))  # map() iterates in C
        device = torch.cuda.current_device()
        key = launch_key(launch, pointers, device)
        bound = self.compiled.get(key)
        if bound is None:
            compiled = launch.kernel[launch.grid](*launch.args, **launch.meta)
            if len(self.compiled) >= MAX_BOUND:
                self.compiled.clear()
            constexprs = tuple(launch.meta[param.name] for param in launch.kernel.params if param.is_constexpr)
            self.compiled[key] = (compiled, constexprs)
            return
        if self.current_stream is None:
            self.current_stream = triton.runtime.driver.active.get_current_stream
        compiled, constexprs = bound
        grid = launch.grid
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     self.current_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                     *pointers, *launch.args[launch.tensors :], *constexprs)  # fmt: skip


def launch_key(launch, pointers, device):
    """The key that ``BoundLaunches`` binds ``launch`` under, its tensors at addresses ``pointers`` on the CUDA device
    ``device``: its plan, the device, and each tensor's dtype and address modulo 16 (which tells Triton's
    specialization of a pointer, a multiple of 16 or not). map() iterates in C: a Python loop over a launch's dozen
    tensors took about a microsecond more per launch."""
    return (launch.plan, device, tuple(map(_DTYPE, launch.args[: launch.tensors])),
            tuple(map(operator.mod, pointers, _SIXTEENS)))  # fmt: skip


_RUNTIME_KNOBS = triton.knobs.runtime if triton is not None and hasattr(triton, "knobs") else None


def _hooks_set():
    """Whether a profiler set Triton's launch hooks (chains of hooks from Triton 3.6, single functions before)."""
    runtime = _RUNTIME_KNOBS
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))  # fmt: skip


def on_device(device):
    """A context in which ``device`` is CUDA's current device, where it is a GPU that is not: a model split across
    GPUs in one process (``device_map="auto"``, or a model moved to another GPU than the current one) runs its layers
    on several, and a kernel launched on another GPU than its tensors' would read them through that GPU's context,
    unordered with their own stream's work, or fail."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return _CURRENT_DEVICE
    return torch.cuda.device(device)


_CURRENT_DEVICE = contextlib.nullcontext()  # reusable: one fewer object per call


# Triton options that Inductor does not pass on to user kernels: its launches run without them (its own default fusion).
UNTRACED_OPTIONS = ("maxnreg", "enable_fp_fusion")


def traced_launch(launch):
    """The launch as torch.compile records it: Inductor compiles and launches the kernel itself."""
    meta = {name: value for name, value in launch.meta.items() if name not in UNTRACED_OPTIONS}
    torch.library.wrap_triton(launch.kernel)[launch.grid](*launch.args, **meta)


def run_launch(launch, query, value, launcher):
    """``launcher(launch)``; a failure (compilation, resources, driver) is re-raised with what a bug report needs."""
    try:
        launcher(launch)
    except Exception as error:
        if query.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(query.device)
            device = f"{torch.cuda.get_device_name(query.device)} (sm_{major}{minor})"
        else:
            device = "the Triton interpreter"
        raise RuntimeError(
            f"the Triton backend failed in {launch.kernel.__name__} for {query.dtype}, head sizes "
            f"{query.shape[-1]}/{value.shape[-1]}, on {device}, with triton {triton.__version__}: "
            f"{type(error).__name__}: {error}. plap_backend='tiled' runs the same maths without Triton."
        ) from error
