"""The Triton backend's static limits and the ``auto`` rule, on simulated CUDA inputs (CPU only).

CUDA inputs are FakeTensors (shape, dtype, strides, device, no memory); the GPU's compute capability and the
Triton version are patched. ``auto`` picks ``triton`` exactly where ``triton_unsupported_reason`` finds no
limit broken, and then only with a launch configuration that tests/attention/test_triton_compile.py compiles for the
table that GPU runs and that dtype; an explicit ``backend="triton"`` raises the reason instead.
"""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.testing_utils import CaptureLogger

from modeling_plat import plap_attention_triton as triton_module
from modeling_plat import triton_configs
from modeling_plat import triton_tiles as tiles
from modeling_plat import plap_dispatch
from modeling_plat.plap_dispatch import choose_backend, plap_attention
from test_triton_compile import SAMPLE

pytestmark = pytest.mark.skipif(triton_module.triton is None, reason="triton is not installed")

# Checked compute capabilities, and below 8.0 and unknown ones (11.0, 13.0, a future 10.x) that run the conservative
# table.
CAPABILITIES = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (10, 7), (11, 0), (12, 0),
                (12, 1), (13, 0)]  # fmt: skip
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HEAD_DIMS = [8, 16, 40, 64, 80, 96, 128, 160, 256, 320]


@pytest.fixture
def gpu(monkeypatch):
    """Simulate a CUDA GPU of the given compute capability; returns a FakeTensorMode for its tensors."""

    def with_capability(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(plap_dispatch, "_cuda_memory", lambda device_index: 80 * 2**30)
        triton_configs.device_capability.cache_clear()  # asked once per process otherwise
        return FakeTensorMode(allow_non_fake_inputs=True)

    yield with_capability
    triton_configs.device_capability.cache_clear()


def cuda_inputs(batch=2, heads=4, nq=128, nk=128, head_dim=64, value_dim=None, dtype=torch.bfloat16, mask=None):
    """(q, k, v, attn_mask) on "cuda"; call inside the FakeTensorMode."""
    q = torch.empty(batch, heads, nq, head_dim, device="cuda", dtype=dtype)
    k = torch.empty(batch, heads, nk, head_dim, device="cuda", dtype=dtype)
    v = torch.empty(batch, heads, nk, value_dim or head_dim, device="cuda", dtype=dtype)
    if mask == "padding":
        mask = torch.ones(batch, 1, 1, nk, device="cuda", dtype=torch.bool)
    elif mask == "full":
        mask = torch.ones(batch, heads, nq, nk, device="cuda", dtype=torch.bool)
    return q, k, v, mask


def compiled_configurations():
    """(table, dtype, LaunchConfig) of every configuration the compile test's sample compiles."""
    compiled = set()
    for case in SAMPLE:
        capability = (case["arch"] // 10, case["arch"] % 10)
        config = triton_module.launch_config(getattr(torch, case["dtype"]), case["head_dim"], case["value_dim"],
                                             capability)  # fmt: skip
        compiled.add((triton_configs.config_table(capability), case["dtype"], config))
    return compiled


def choose(q, k, v, mask, backend="auto", p=None):
    """The backend the dispatcher picks (p defaults to the paper's p < 2 on every head)."""
    p = (1.5,) * q.shape[1] if p is None else tuple(p.tolist())
    return choose_backend(backend, q, k, v, p=p, attn_mask=mask).name


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_auto_picks_triton_only_where_compiled(gpu, capability):
    compiled = compiled_configurations()
    choices = set()
    with gpu(capability):
        for dtype, head_dim, ratio, mask in itertools.product(DTYPES, HEAD_DIMS, (1, 2), (None, "padding", "full")):
            q, k, v, attn_mask = cuda_inputs(head_dim=head_dim, value_dim=head_dim * ratio, dtype=dtype, mask=mask)
            reason = triton_module.triton_unsupported_reason(q, k, v, p=(1.5,), attn_mask=attn_mask)
            choice = choose(q, k, v, attn_mask)
            choices.add(choice)
            assert (choice == "triton") == (reason is None), (dtype, head_dim, mask, reason)
            if choice == "triton":
                config = triton_module.launch_config(dtype, q.shape[-1], v.shape[-1], capability)
                table = triton_configs.config_table(capability)
                assert (table, str(dtype).removeprefix("torch."), config) in compiled
            else:  # small inputs: eager, within its share of the GPU's memory
                assert choice == "eager"
                with pytest.raises(ValueError, match="backend 'triton' cannot run this input: " + reason[:20]):
                    choose(q, k, v, attn_mask, backend="triton")
    assert ("triton" in choices) == (capability >= (8, 0))


def test_the_compute_capability_is_asked_once_per_device(gpu, monkeypatch):
    with gpu((9, 0)):
        asked = []
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
        q, k, v, _ = cuda_inputs()
        for _ in range(3):
            assert choose(q, k, v, None) == "triton"
            assert triton_module.triton_unsupported_reason(q, k, v, p=(1.5,)) is None
    assert len(asked) == 1


def test_the_rule_on_named_cases(gpu):
    with gpu((9, 0)):
        assert choose(*cuda_inputs(dtype=torch.bfloat16, head_dim=128)) == "triton"
        assert choose(*cuda_inputs(dtype=torch.float16, head_dim=80, mask="padding")) == "triton"
        assert choose(*cuda_inputs(dtype=torch.float16, head_dim=160)) == "triton"
        assert choose(*cuda_inputs(head_dim=256)) == "triton"
        assert choose(*cuda_inputs(head_dim=320)) == "eager"  # no tiles above head size 256
        assert choose(*cuda_inputs(dtype=torch.float32, head_dim=128)) == "triton"
        assert choose(*cuda_inputs(dtype=torch.float32, head_dim=256, mask="padding")) == "triton"
        assert choose(*cuda_inputs(dtype=torch.float32, head_dim=320)) == "eager"
        assert choose(*cuda_inputs(mask="full")) == "eager"  # only key padding is fused
        assert choose(*cuda_inputs(dtype=torch.float64)) == "eager"
        q, k, v, mask = cuda_inputs(mask="padding")
        assert choose(q, k, v, mask.cpu()) == "eager"  # a mask left on the CPU
    with gpu((7, 5)):
        assert choose(*cuda_inputs()) == "eager"  # no bfloat16 tensor cores
        with pytest.raises(ValueError, match="compute capability 7.5 is below 8.0: the kernels' matmuls take bfloat16"):
            choose(*cuda_inputs(), backend="triton")


def test_each_gpu_runs_its_familys_table_and_unknown_ones_the_conservative_one():
    """12.x runs the 8.x tiles (mma.sync, 99 KB), 10.x its own; a compute capability the tables do not know, from 8.0
    on, runs the table sized for the least shared memory, and is told so once."""
    limits = triton_configs.SHARED_MEMORY_LIMIT
    for capability in limits:
        assert triton_configs.config_table(capability) == {12: 8}.get(capability[0], capability[0])
    conservative = triton_configs.CONFIGS[triton_configs.CONSERVATIVE_TABLE, "half"]
    users = [limit for capability, limit in limits.items()
             if triton_configs.config_table(capability) == triton_configs.CONSERVATIVE_TABLE]  # fmt: skip
    assert min(users) == min(limits.values())  # sized for the least shared memory
    with CaptureLogger(triton_configs.logger) as captured:
        for _ in range(3):
            assert triton_configs.launch_config(torch.bfloat16, 128, 128, (11, 4)) == conservative[128]
            assert triton_configs.capability_reason((11, 4), torch.bfloat16, 128, 128) is None
        assert triton_configs.launch_config(torch.bfloat16, 128, 128, (10, 0)) == triton_configs.CONFIGS[10, "half"][128]
    assert captured.out.count("compute capability 11.4 is not one the fused Triton kernels are checked for") == 1
    assert "runs the tiles of compute capability 8.x" in captured.out
    assert triton_configs.launch_config(torch.bfloat16, 64, 64, (7, 5)) is None


@pytest.mark.parametrize("kernel, exact_block", [("dkdv", 48), ("dq", 128), ("fwd", 32)])
def test_an_exact_block_divides_a_backward_kernel_s_fixed_block(kernel, exact_block):
    """``KernelConfig.exact_block`` is a backward kernel's alone (the forward's exact pass reads the flags its first
    pass wrote for its own blocks), and divides the first pass's fixed block: planned calls refuse any other, before a
    launch. The tables set none that breaks it."""
    config = triton_configs.INTERPRETER_CONFIG  # blocks of 64
    bad = config._replace(**{kernel: getattr(config, kernel)._replace(exact_block=exact_block)})
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match=f"exact_block={exact_block} must divide a backward kernel's fixed block"):
        triton_module.call_plan(q, q, q, q, (1.5, 2.5), True, 0, False, False, False, 1e-6, bad, False)
    fixed = {"dkdv": "block_n", "dq": "block_m"}
    for (generation, kind), table in triton_configs.CONFIGS.items():
        for launch in table.values():
            assert launch.fwd.exact_block == 0
            assert all(getattr(launch, name).exact_block == 0
                       or getattr(getattr(launch, name), field) % getattr(launch, name).exact_block == 0
                       for name, field in fixed.items())  # fmt: skip


def test_mismatched_dtypes_leave_the_kernels(gpu):
    with gpu((8, 0)):
        q, k, v, _ = cuda_inputs(dtype=torch.bfloat16)
        v = v.float()  # a KV cache kept in another dtype
        assert "dtypes differ" in triton_module.triton_unsupported_reason(q, k, v, p=(1.5,))
        assert choose(q, k, v, None) == "eager"


def test_many_heads_and_large_tensors_are_fine(gpu):
    """B * H is not limited by CUDA's 65535 on grid axis 1 (the grid is 1-D), and tensors above 2^31
    elements run with int64 (batch, head) offsets; only a single (batch, head) past 2^31 is refused."""
    with gpu((9, 0)):
        assert choose(*cuda_inputs(batch=700, heads=100, nq=64, nk=64)) == "triton"
        assert choose(*cuda_inputs(batch=64, heads=16, nq=16384, nk=16384, head_dim=128)) == "triton"  # 2^31 elements
        q, k, v, _ = cuda_inputs(batch=1, heads=1, nq=16, nk=2**24 + 16, head_dim=128)
        assert "int32 offsets would overflow" in triton_module.triton_unsupported_reason(q, k, v, p=(1.5,))
        # (B, N, H, d) projections viewed as (B, H, N, d), whose rows of all heads pass int32 offsets: the kernels take
        # a contiguous copy (plap_attention_triton.kernel_layout), whose one head's rows do not.
        projected = torch.empty(1, 2**21, 32, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        assert choose(projected, projected, projected, None) == "triton"


def test_float16_with_large_p_leaves_the_kernels(gpu):
    """Above FLOAT16_MAX_P the weights can overflow float16 in the kernels' matmuls: auto takes eager (float32
    inside); bfloat16, and float16 at the paper's p, stay on triton."""
    mix, large = torch.tensor([1.5, 1.5, 2.5, 2.5]), torch.tensor([1.5, 4.0, 2.0, 2.5])
    with gpu((9, 0)):
        q, k, v, _ = cuda_inputs(dtype=torch.float16)
        assert choose(q, k, v, None, p=mix) == "triton"
        assert choose(q, k, v, None, p=large) == "eager"
        with pytest.raises(ValueError, match="float16 with p = 4: above p = 3 .*use bfloat16"):
            choose(q, k, v, None, "triton", p=large)
        q, k, v, _ = cuda_inputs(dtype=torch.bfloat16)
        assert choose(q, k, v, None, p=large) == "triton"


@pytest.mark.skipif(not triton_module.INTERPRETED, reason="launches the kernels under the interpreter")
def test_the_float16_limit_on_p_is_real():
    """p = 5, uniform attention over 127 equal values and one at distance 45: P = 45^3 = 91,125 passes float16's
    65,504 inside the kernels although every output (at most 91,125 * 45 / 128) fits."""
    q = torch.zeros(1, 1, 128, 16, dtype=torch.float16)
    v = torch.zeros(1, 1, 128, 16, dtype=torch.float16)
    v[0, 0, -1, 0] = 45
    p = torch.tensor([5.0])
    reference = plap_attention(q.double(), q.double(), v.double(), p, backend="eager")
    assert reference.abs().max() < torch.finfo(torch.float16).max
    assert not torch.isfinite(triton_module.plap_attention_triton(q, q, v, p=(5.0,))).all()  # a direct call is unchecked
    torch.testing.assert_close(plap_attention(q, q, v, p, backend="tiled").double(), reference, rtol=2e-3, atol=1e-3)
    with pytest.raises(ValueError, match="float16 with p = 5"):
        plap_attention(q, q, v, p, backend="triton")


def test_old_triton_leaves_the_kernels(gpu, monkeypatch):
    monkeypatch.setattr(triton_module, "TRITON_VERSION", (3, 4))
    with gpu((9, 0)):
        q, k, v, _ = cuda_inputs()
        assert choose(q, k, v, None) == "eager"
        with pytest.raises(ValueError, match=r"triton \S+ is older than 3\.5"):
            choose(q, k, v, None, backend="triton")


@pytest.mark.skipif(not triton_module.INTERPRETED, reason="launches the kernels under the interpreter")
def test_a_launch_failure_names_the_configuration(monkeypatch):
    from triton.runtime.errors import OutOfResources

    class FailingKernel:
        __name__ = "plap_forward_kernel"

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(263168, 232448, "shared memory")

            return launch

    monkeypatch.setattr(triton_module, "plap_forward_kernel", FailingKernel())
    triton_module._call_plan.cache_clear()  # the plans kept hold the kernels they were made with
    q = torch.zeros(1, 2, 8, 16, dtype=torch.float16)
    try:
        with pytest.raises(RuntimeError) as failure:
            triton_module.plap_attention_triton(q, q, q, p=(1.5, 1.5))
    finally:
        triton_module._call_plan.cache_clear()
    message = str(failure.value)
    for part in ("plap_forward_kernel", "torch.float16", "head sizes 16/16", "the Triton interpreter",
                 f"triton {triton_module.triton.__version__}", "out of resource: shared memory",
                 "plap_backend='tiled'"):  # fmt: skip
        assert part in message
    assert isinstance(failure.value.__cause__, OutOfResources)


@pytest.mark.parametrize("merge_quarters", [False, True])
@pytest.mark.parametrize(
    "p",
    [(1.5,) * 4 + (2.5,) * 4, (1.5, 2.5, 3.0, 3.0, 1.5), (1.5,) * 20 + (2.5,) * 20, (1.1, 1.5, 2.0, 2.5, 3.0), (2.5,),
     (3.0,) * 33],
)  # fmt: skip
def test_launch_groups_cover_every_head_once_with_its_p(p, merge_quarters):
    """Every head runs in exactly one launch, which gives it its p (the high one where its bit is set); a launch's
    heads are at most MAX_LAUNCH_HEADS consecutive ones with at most two values of p. The paper's two p take a class
    each (whose launch runs its p's heads), or both one where ``merge_quarters``; any other p the general class."""
    classes = {int(tiles.POWER_ANY): None, int(tiles.POWER_MINUS_QUARTER): 1.5, int(tiles.POWER_QUARTER): 2.5,
               int(tiles.POWER_QUARTERS): None}  # the p a class's launch runs, None: every p of the run  # fmt: skip
    ran = []
    for first, end, power, low, high, high_heads in triton_module.launch_groups(p, merge_quarters):
        assert end - first <= triton_module.MAX_LAUNCH_HEADS and -(2**31) <= high_heads < 2**31  # an int32
        assert {p[h] for h in range(first, end)} == {low, high}
        assert (power == int(tiles.POWER_ANY)) == (not {low, high} <= {1.5, 2.5})
        assert (power == int(tiles.POWER_QUARTERS)) == (merge_quarters and {low, high} == {1.5, 2.5})
        for h in range(first, end):
            assert p[h] == (high if (high_heads >> (h - first)) & 1 else low)
            if classes[power] in (None, p[h]):
                ran.append(h)
    assert sorted(ran) == list(range(len(p)))


NEW_TENSORS = {"empty", "empty_like", "new_empty"}
VIEWS = {"detach", "select"}


class OpNames(TorchDispatchMode):
    """The ATen operations that run, by name."""

    def __enter__(self):
        self.names = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not triton_module.INTERPRETED, reason="the Triton backend runs on CPU only under the interpreter")
@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("pairs_over_limit", [0, 1])
def test_a_call_runs_the_kernels_and_allocations_only(monkeypatch, formulation, pairs_over_limit):
    """The host work of a bfloat16 forward + backward, launches recorded instead of run: the values' norms (one
    reduction; the kernels square them), each kernel's two passes (forward, dQ, dK/dV) or, up to ONE_PASS_PAIRS, its
    exact pass alone with both p in one launch, and no other tensor operation but allocations and views: no cast,
    square, row statistic, zero gradient or flag fill (the first pass zeroes the flags it needs zeroed), each of which
    is a kernel and its host time on a GPU."""
    launches = []
    monkeypatch.setattr(triton_module, "_run", lambda launch, query, value: launches.append(
        (launch.kernel.__name__, bool(launch.meta["PASS"]))))  # fmt: skip
    shape = (2, 4, 40, 16)
    monkeypatch.setattr(triton_module, "ONE_PASS_PAIRS", shape[0] * shape[1] * shape[2] ** 2 - pairs_over_limit)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.ones(shape, dtype=torch.bfloat16)
    with OpNames() as ops:
        out = plap_attention(q, k, v, (1.5, 1.5, 2.5, 2.5), is_causal=True, backend="triton", formulation=formulation)
        grads = torch.autograd.grad(out, (q, k, v), grad)
    passes = (False, True) if pairs_over_limit else (True,)
    launches_per_pass = 2 if pairs_over_limit else 1  # one per p, or both p in one launch
    assert launches == [(f"plap_{kernel}_kernel", exact) for kernel in ("forward", "dq", "dkdv")
                        for _ in range(launches_per_pass) for exact in passes]  # fmt: skip
    computed = [name for name in ops.names if name not in NEW_TENSORS | VIEWS]
    assert computed == ["linalg_vector_norm"], ops.names
    # out, the row statistics (one tensor: lse, and euler's own weights), two flag tensors; delta (and euler's own dot
    # products), dq, dk, dv and dv's query side
    assert sum(name in NEW_TENSORS for name in ops.names) == 9 + (formulation == "euler"), ops.names
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3


@pytest.mark.parametrize("alone", [True, False])
def test_the_paper_mix_is_one_launch_per_kernel_pass_of_small_calls(alone):
    """The p = 1.5 and p = 2.5 heads, interleaved as they may be, run in one launch of each kernel's exact pass alone
    (small calls), with both square-root chains, or in one launch per p of each of the two passes of larger calls,
    each with its own chain. Every launch's grid covers the run of heads, whose programs take their head's exponent
    from the launch's bit mask (and leave where their p is the other launch's)."""
    batch, heads, length, head_dim = 2, 8, 100, 16
    p = (1.5, 2.5, 2.5, 1.5, 1.5, 2.5, 1.5, 2.5)
    query = torch.zeros(batch, heads, length, head_dim)
    stats, norms = torch.zeros(batch, heads, length), torch.zeros(batch, heads, length)
    flags = (p, True, 1e-6, False, triton_configs.INTERPRETER_CONFIG, alone)
    exact_blocks = [torch.zeros(n) for n in triton_module.exact_block_counts(query, query,
                                                                             triton_configs.INTERPRETER_CONFIG)]
    forward = triton_module.forward_launches(query, query, query, norms, None, None, query, stats, exact_blocks,
                                             *flags)  # fmt: skip
    backward = triton_module.backward_launches(query, query, query, norms, None, None, query, query, stats, stats,
                                               stats, query, query, query, query, exact_blocks, *flags)  # fmt: skip
    launched = [(launch.kernel.__name__, launch.meta["POWER"], launch.meta["PASS"]) for launch in forward + backward]
    classes = [tiles.POWER_QUARTERS] if alone else [tiles.POWER_MINUS_QUARTER, tiles.POWER_QUARTER]
    passes = [tiles.EXACT_ALONE] if alone else [tiles.FIRST_PASS, tiles.EXACT_PASS]
    assert launched == [(f"plap_{kernel}_kernel", power, exact) for kernel in ("forward", "dq", "dkdv")
                        for power in classes for exact in passes]  # fmt: skip
    for launch in forward + backward:
        # after the tensors, the run of heads, the sizes, the window and the scale: (p - 2) / 2 of the low and high p,
        # then bit h set where head h takes the high one
        scalars = launch.args[launch.tensors :]
        assert scalars[7:10] == (-0.25, 0.25, sum(1 << h for h in range(heads) if p[h] == 2.5))
        assert launch.grid == (2 * batch * heads,)  # two 64-row blocks per head, every head
