"""The bound launch path (``triton_launcher.BoundLaunches``): a launch reuses a compiled kernel only where Triton would
have specialized it the same way, and passes it the arguments Triton's own launch would.

A recording kernel stands in for Triton's (no GPU here): indexing it by a grid and calling it is Triton's own launch,
which returns the compiled kernel; the compiled kernel's ``run`` records what it is given."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from device import DEVICE

from modeling_plat import plap_attention_triton as triton_module
from modeling_plat import triton_launcher
from modeling_plat.triton_configs import INTERPRETER_CONFIG

pytestmark = pytest.mark.skipif(triton_module.triton is None, reason="triton is not installed")


class RecordingKernel:
    params = [SimpleNamespace(name="Q", is_constexpr=False), SimpleNamespace(name="HEAD_DIM", is_constexpr=True),
              SimpleNamespace(name="BLOCK_M", is_constexpr=True)]  # fmt: skip

    def __init__(self):
        self.through_triton, self.runs = [], []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.through_triton.append((grid, args, meta))
            return SimpleNamespace(run=lambda *run_args: self.runs.append(run_args), function="f", packed_metadata="m")

        return launch


@pytest.fixture
def bound(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launches = triton_launcher.BoundLaunches()
    launches.enabled, launches.current_stream = True, lambda device: "stream"
    return launches


def forward_launches(kernel, query, flags=None):
    """The launches of a forward on these tensors, with ``kernel`` in place of the forward kernel."""
    batch, heads, length, _ = query.shape
    sq_norms, stats = (torch.zeros(batch, heads, length, dtype=torch.float32) for _ in range(2))
    exact_blocks = (sq_norms.new_empty(0, dtype=torch.int32),) * 2
    launches = triton_module.forward_launches(query, query, query, sq_norms, None, None, query, stats, exact_blocks,
                                              (1.5, 1.5), True, 1e-6, False, INTERPRETER_CONFIG,
                                              exact_only=True)  # fmt: skip
    return [launch._replace(kernel=kernel) for launch in launches]


def test_a_repeated_launch_runs_the_compiled_kernel_with_triton_s_arguments(bound):
    kernel = RecordingKernel()
    query = torch.zeros(1, 2, 40, 16, dtype=torch.bfloat16)
    (launch,) = forward_launches(kernel, query)
    bound(launch)  # the first: through Triton, which compiles
    assert len(kernel.through_triton) == 1 and not kernel.runs
    bound(launch)
    assert len(kernel.through_triton) == 1
    tensors = launch.args[: launch.tensors]
    assert all(isinstance(tensor, torch.Tensor) for tensor in tensors)
    assert not any(isinstance(arg, torch.Tensor) for arg in launch.args[launch.tensors :])
    expected = (launch.grid[0], 1, 1, "stream", "f", "m", None, None, None, *(t.data_ptr() for t in tensors),
                *launch.args[launch.tensors :], launch.meta["HEAD_DIM"], launch.meta["BLOCK_M"])  # fmt: skip
    assert kernel.runs == [expected]


def test_launches_are_bound_again_where_triton_specializes_them_again(bound):
    kernel = RecordingKernel()
    base = torch.zeros(2 * 40 * 16 + 8, dtype=torch.bfloat16)
    aligned = base[: 2 * 40 * 16].view(1, 2, 40, 16)
    bound(forward_launches(kernel, aligned)[0])
    bound(forward_launches(kernel, torch.zeros(1, 2, 40, 16, dtype=torch.bfloat16))[0])  # new tensors, same kind
    assert len(kernel.through_triton) == 1 and len(kernel.runs) == 1
    unaligned = base[1 : 2 * 40 * 16 + 1].view(1, 2, 40, 16)  # an address 2 bytes past a multiple of 16
    other_dtype = torch.zeros(1, 2, 40, 16, dtype=torch.float16)
    other_shape = torch.zeros(1, 2, 41, 16, dtype=torch.bfloat16)  # other scalar arguments (lengths)
    for query in (unaligned, other_dtype, other_shape):
        before = len(kernel.through_triton)
        bound(forward_launches(kernel, query)[0])
        assert len(kernel.through_triton) == before + 1
    assert len(kernel.runs) == 1


def test_launches_go_through_triton_while_its_launch_hooks_are_set(bound, monkeypatch):
    kernel = RecordingKernel()
    (launch,) = forward_launches(kernel, torch.zeros(1, 2, 40, 16))
    bound(launch)
    monkeypatch.setattr(triton_launcher, "_hooks_set", lambda: True)  # a profiler's
    bound(launch)
    assert len(kernel.through_triton) == 2 and not kernel.runs


def test_on_device_makes_a_gpu_current_only_where_it_is_not(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(triton_launcher.on_device(torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(triton_launcher.on_device(torch.device("cuda", 0)), contextlib.nullcontext)
    guard = triton_launcher.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


def test_every_launch_of_a_call_runs_on_its_inputs_device(monkeypatch):
    """Forward and backward: Triton launches on CUDA's current device, which a model split across GPUs does not keep
    on its tensors' (test_backends.py runs it on two GPUs)."""
    entered, launched = [], []

    @contextlib.contextmanager
    def on_device(device):
        entered.append(device)
        yield
        entered.append(None)

    def run(launch, query, value):
        launched.append(entered[-1:] == [query.device])
        original(launch, query, value)

    original = triton_module._run
    monkeypatch.setattr(triton_module, "on_device", on_device)
    monkeypatch.setattr(triton_module, "_run", run)
    query = torch.randn(1, 2, 20, 16, device=DEVICE, requires_grad=True)
    out = triton_module.plap_attention_triton(query, query, query, p=(1.5, 2.5), is_causal=True)
    forward_launches = len(launched)
    out.sum().backward()
    assert forward_launches and len(launched) > forward_launches
    assert all(launched) and entered[-1] is None


def test_a_call_s_launches_are_planned_once_per_shape_and_layout(monkeypatch):
    """The launches of a call's three kernels are planned once per shapes, layouts and arguments in eager calls
    (``call_plan``): a repeated call plans nothing, and another layout of the same shapes (a model's tokens-major
    views) or another p gets launches of its own, those a fresh plan gives."""
    triton_module._call_plan.cache_clear()  # plans of earlier tests' calls
    planned, plan = [], triton_module._launch_plan
    monkeypatch.setattr(triton_module, "_launch_plan", lambda *args: planned.append(args[0]) or plan(*args))
    recorded = []
    monkeypatch.setattr(triton_module, "_run", lambda launch, query, value: recorded.append(launch))
    contiguous = torch.randn(1, 2, 20, 16, device=DEVICE, requires_grad=True)
    tokens_major = contiguous.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()

    def call(query, p=(1.5, 2.5)):
        planned.clear(), recorded.clear()
        triton_module.plap_attention_triton(query, query, query, p=p, is_causal=True).sum().backward()
        return len(planned), [(launch.kernel, launch.grid, launch.args[launch.tensors :], launch.meta)
                              for launch in recorded]  # fmt: skip

    first = call(contiguous)
    assert first[0] == 3 and len(first[1]) == 3  # forward, dq, dk/dv: the exact pass alone at this size
    assert call(contiguous) == (0, first[1])
    other_layout = call(tokens_major)
    assert other_layout[0] == 3 and other_layout[1] != first[1]  # the row strides of tokens-major rows are H * d
    assert call(tokens_major) == (0, other_layout[1])
    assert call(contiguous, p=(1.5, 1.5))[0] == 3
