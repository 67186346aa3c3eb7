"""Every p-Laplacian attention backend against the independent float64 reference (tests/reference.py).

Outputs and the gradients of q, k and v, as relative errors ||ours - ref|| / ||ref||, over awkward shapes, on
the tests' device (tests/device.py). On the CPU the Triton kernels run under the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports the Triton module), whose half-precision case
is float16 (TRITON_HALF); on a GPU they are compiled, bfloat16 included.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from modeling_plat import plap_attention
from modeling_plat import plap_attention_triton as triton_module
from modeling_plat.plap_dispatch import EAGER_MAX_SCORES_PER_THREAD_CPU, choose_backend
from modeling_plat.plap_attention_decode import DECODE_MAX_QUERIES
from modeling_plat.plap_attention_tiled import plap_attention_tiled
from device import DEVICE, ON_CUDA, TRITON_HALF, needs_cuda
from reference import reference_plap_attention

plap_attention_module = importlib.import_module("modeling_plat.plap_dispatch")
TRITON_MISSING = triton_module.triton is None
needs_triton = pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (pip install triton)")
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
# The paper's pair first (the Triton kernels' square-root chains: one launch where a call's exact pass runs alone, a
# launch each beside a first pass), then other p, two in one launch and one alone (exp2 of log2).
P_MIX = (1.5, 2.5, 1.1, 2.0, 3.0)


def make_inputs(batch, heads, nq, nk, d, dv, dtype, seed=0, duplicates=False, device=DEVICE):
    """[q, k, v] requiring grad and p per head, on ``device``: drawn on the CPU, the same values on every device."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, nq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, heads, nk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, heads, nk, dv, generator=gen, dtype=torch.float64)
    if duplicates:
        v[:, :, 1] = v[:, :, 0]  # zero distance off the diagonal, and for p < 2 a huge weight
        v[:, :, -1] = v[:, :, 0]
    p = torch.tensor([P_MIX[h % len(P_MIX)] for h in range(heads)])
    return [t.to(device, dtype).requires_grad_() for t in (q, k, v)], p.to(device)


def make_mask(kind, batch, heads, nq, nk, device=DEVICE):
    """None, key padding (B, 1, 1, Nk) with the last of several sequences fully masked, or a full (B, H, Nq, Nk)
    mask."""
    if kind is None:
        return None
    gen = torch.Generator().manual_seed(1)
    if kind == "padding":
        keep = torch.ones(batch, nk, dtype=torch.bool)
        keep[0, :3] = False  # left padding
        if batch > 1:  # a sequence with every key masked: its rows output zeros (alone, nothing would be checked)
            keep[-1, :] = False
        return keep[:, None, None, :].to(device)
    keep = torch.rand(batch, heads, nq, nk, generator=gen) > 0.4
    keep[0, 0, nq // 2] = False  # one fully masked row
    return keep.to(device)


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def check(run, inputs, p, dtype, **kwargs):
    q, k, v = inputs
    out = run(q, k, v, p, **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + v.shape[-1:]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out))
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference_plap_attention(*ref_inputs, p.double(), **kwargs)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.to(ref))
    tol = TOLERANCE[dtype]
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert torch.isfinite(ours).all(), name
        assert relative_error(ours, theirs) <= tol, (name, relative_error(ours, theirs))


def tiled_small_blocks(query, key, value, p, **kwargs):
    """Blocks much smaller than the sequences: several online-softmax steps and partial tiles."""
    return plap_attention_tiled(query, key, value, p=tuple(p.tolist()), **kwargs, blocks=(1, 16, 24))


def chosen(backend, query, key=None, value=None, p=None, **kwargs):
    """The name of the backend the dispatcher picks for these heads."""
    key = query if key is None else key
    value = key if value is None else value
    p = (1.5,) * query.shape[1] if p is None else p
    return choose_backend(backend, query, key, value, p=p, **kwargs).name


def run_triton(query, key, value, p, **kwargs):
    """The Triton backend called as the dispatcher calls it: p as a tuple of floats."""
    return triton_module.plap_attention_triton(query, key, value, p=tuple(p.tolist()), **kwargs)


def triton_small_blocks(*args, **kwargs):
    return run_triton(*args, **kwargs, blocks=(16, 16))


# (B, H, Nq, Nk, d, dv): square and awkward; Nq < Nk (a KV cache, bottom-right aligned); a few queries; one.
SHAPES = [(2, 5, 63, 63, 60, 60), (2, 3, 21, 50, 16, 24), (2, 3, 4, 50, 16, 24), (3, 2, 1, 33, 16, 8)]
TORCH_BACKENDS = {
    "eager": lambda *a, **kw: plap_attention(*a, **kw, backend="eager"),
    "decode": lambda *a, **kw: plap_attention(*a, **kw, backend="decode"),
    "tiled": lambda *a, **kw: plap_attention(*a, **kw, backend="tiled"),
    "tiled-small-blocks": tiled_small_blocks,
}


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("mask", [None, "padding", "full"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_torch_backends_float32(backend, shape, is_causal, mask, formulation):
    if backend == "decode" and shape[2] > DECODE_MAX_QUERIES:
        pytest.skip("the decode path takes a few queries only")
    inputs, p = make_inputs(*shape, torch.float32)
    attn_mask = make_mask(mask, *shape[:4])
    kwargs = dict(attn_mask=attn_mask, is_causal=is_causal, formulation=formulation)
    check(TORCH_BACKENDS[backend], inputs, p, torch.float32, **kwargs)


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["tiled", "tiled-small-blocks"])
def test_tiled_half_precision(backend, dtype, formulation):
    shape = (2, 5, 40, 47, 32, 32)
    inputs, p = make_inputs(*shape, dtype)
    check(TORCH_BACKENDS[backend], inputs, p, dtype, is_causal=True, formulation=formulation)


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("backend", ["tiled", "tiled-small-blocks"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tiled_duplicate_values(backend, formulation, dtype):
    # Exact duplicates (D2 = 0 off the diagonal, P at its steepest) meet the tolerances of inputs without them;
    # tests/attention/test_repeated_values.py covers every backend, runs of repeats and near duplicates.
    shape = (2, 5, 30, 30, 20, 20)
    inputs, p = make_inputs(*shape, dtype, duplicates=True)
    check(TORCH_BACKENDS[backend], inputs, p, dtype, attn_mask=make_mask("padding", *shape[:4]),
          formulation=formulation)  # fmt: skip


def test_tiled_p2_is_softmax_attention():
    inputs, _ = make_inputs(2, 4, 37, 37, 16, 16, torch.float32)
    p = torch.full((4,), 2.0, device=DEVICE)
    for formulation in ("paper", "euler"):
        ours = tiled_small_blocks(*inputs, p, is_causal=True, formulation=formulation)
        sdpa = F.scaled_dot_product_attention(*inputs, is_causal=True)
        torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-6)


def routed_heads(monkeypatch):
    """Record the head count of every call that reaches SDPA through the dispatcher."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting_sdpa(query, *args, **kwargs):
        calls.append(query.shape[1])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(plap_attention_module.F, "scaled_dot_product_attention", counting_sdpa)
    return calls


SOFTMAX_MIX = (2.0, 1.5, 2.0, 2.0, 2.5)  # runs: softmax, p-Laplacian, softmax (2 heads), p-Laplacian


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("mask", [None, "padding", "full"])
@pytest.mark.parametrize("backend", ["auto", "eager", "tiled"])
def test_p2_heads_run_through_sdpa(monkeypatch, backend, mask, formulation):
    """Each run of p = 2 heads goes to SDPA inside the same call; Nq < Nk causal, masks, fully masked rows."""
    calls = routed_heads(monkeypatch)
    shape = (2, 5, 21, 50, 16, 24)
    inputs, _ = make_inputs(*shape, torch.float32)
    p = torch.tensor(SOFTMAX_MIX, device=DEVICE)
    run = lambda *a, **kw: plap_attention(*a, **kw, backend=backend)  # noqa: E731
    check(run, inputs, p, torch.float32, attn_mask=make_mask(mask, *shape[:4]), is_causal=True,
          formulation=formulation)  # fmt: skip
    assert calls == [1, 2]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_softmax_twin_matches_reference(monkeypatch, dtype, is_causal):
    calls = routed_heads(monkeypatch)
    shape = (2, 3, 17, 17, 16, 16)
    inputs, _ = make_inputs(*shape, dtype)
    p = torch.full((3,), 2.0, device=DEVICE)
    check(plap_attention, inputs, p, dtype, attn_mask=make_mask("padding", *shape[:4]), is_causal=is_causal)
    assert calls == [3]


def test_rows_without_keys_are_zero_whatever_sdpa_returns(monkeypatch):
    """Some SDPA kernels return NaN on rows with no allowed key; the dispatcher never shows them one."""
    sdpa = F.scaled_dot_product_attention

    def nan_on_empty_rows(query, key, value, attn_mask=None, **kwargs):
        out = sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
        return out if attn_mask is None else torch.where(attn_mask.any(-1, keepdim=True), out, torch.nan)

    monkeypatch.setattr(plap_attention_module.F, "scaled_dot_product_attention", nan_on_empty_rows)
    shape = (2, 2, 9, 9, 8, 8)
    inputs, _ = make_inputs(*shape, torch.float32)
    check(plap_attention, inputs, torch.full((2,), 2.0, device=DEVICE), torch.float32,
          attn_mask=make_mask("full", *shape[:4]))  # fmt: skip


def test_p_requiring_grad():
    inputs, p = make_inputs(1, 2, 8, 8, 4, 4, torch.float32)
    p.requires_grad_()
    with pytest.raises(ValueError, match="no gradient for p"):
        plap_attention(*inputs, p, backend="tiled")
    assert chosen("auto", *inputs, p=p, p_trains=True) == "eager"
    plap_attention(*inputs, p).sum().backward()  # auto: eager, which differentiates p
    assert p.grad is not None and torch.isfinite(p.grad).all()


def test_auto_backend_choice():
    """A few queries: decode. On CPU eager up to EAGER_MAX_SCORES_PER_THREAD_CPU scores per thread, tiled above;
    on CUDA the fused kernels whatever the size."""
    limit = EAGER_MAX_SCORES_PER_THREAD_CPU * torch.get_num_threads()
    rows = 8
    query = torch.zeros(1, 1, rows, 4, device=DEVICE)
    keys_at_limit, keys_above = (torch.zeros(1, 1, 1, 4, device=DEVICE).expand(1, 1, n, 4)
                                 for n in (limit // rows, limit // rows + 1))  # fmt: skip
    assert chosen("auto", query[:, :, :DECODE_MAX_QUERIES], keys_above) == "decode"
    if not ON_CUDA:
        assert chosen("auto", query, keys_at_limit) == "eager"
        assert chosen("auto", query, keys_above) == "tiled"
    elif not TRITON_MISSING:
        assert chosen("auto", query, keys_at_limit) == chosen("auto", query, keys_above) == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        chosen("flash", query)


def test_triton_unavailable_is_an_error(monkeypatch):
    # CPU tensors on purpose: outside the interpreter (a GPU machine, or here once the flag is off) they are refused.
    cpu_query = torch.zeros(1, 1, 4, 4, device="cpu")
    monkeypatch.setattr(triton_module, "INTERPRETED", False)
    if not TRITON_MISSING:
        with pytest.raises(ValueError, match="need CUDA tensors"):
            chosen("triton", cpu_query)
    # Without Triton, the tensors the kernels would otherwise run (the interpreter's CPU ones, or CUDA ones) say so.
    monkeypatch.setattr(triton_module, "triton", None)
    with pytest.raises(ValueError, match="triton is not installed"):
        chosen("triton", torch.zeros(1, 1, 4, 4, device=DEVICE))


@needs_triton
def test_triton_rejects_general_masks():
    query = torch.zeros(2, 3, 4, 4, device=DEVICE)
    full_mask = torch.ones(2, 3, 4, 4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="key-padding"):
        chosen("triton", query, attn_mask=full_mask)
    assert chosen("triton", query, attn_mask=full_mask[:, :1, :1]) == "triton"


TRITON_SHAPES = [(2, 3, 33, 33, 16, 16), (2, 2, 17, 33, 16, 24)]
TRITON_DTYPES = [torch.float32, TRITON_HALF]


@needs_triton
@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("mask", [None, "padding"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=str)
def test_triton_float32(shape, is_causal, mask, formulation):
    inputs, p = make_inputs(*shape, torch.float32)
    kwargs = dict(attn_mask=make_mask(mask, *shape[:4]), is_causal=is_causal, formulation=formulation)
    check(triton_small_blocks, inputs, p, torch.float32, **kwargs)


@needs_triton
@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("dtype", TRITON_DTYPES[1:])
def test_triton_half_precision(dtype, formulation):
    shape = TRITON_SHAPES[1]
    inputs, p = make_inputs(*shape, dtype)
    check(triton_small_blocks, inputs, p, dtype, attn_mask=make_mask("padding", *shape[:4]), is_causal=True,
          formulation=formulation)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype, formulation", [(TRITON_DTYPES[0], "paper"), (TRITON_DTYPES[-1], "euler")], ids=str)
@pytest.mark.parametrize("shape", [(2, 2, 21, 37, 160, 160), (2, 2, 21, 37, 256, 256), (2, 2, 21, 37, 96, 160)],
                         ids=str)  # fmt: skip
def test_triton_largest_head_sizes(shape, dtype, formulation):
    """Head sizes of the largest bucket (256; 160 and a value size of 160 pad to it), with repeated tokens: values
    equal to another key's, whose zero distances take the exact pass. Each dtype with one formulation (the
    interpreter's cost grows with the head size; test_triton_float32 crosses formulations with masks)."""
    inputs, p = make_inputs(*shape, dtype, duplicates=True)
    check(triton_small_blocks, inputs, p, dtype, attn_mask=make_mask("padding", *shape[:4]), is_causal=True,
          formulation=formulation)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("formulation", ["paper", "euler"])
def test_triton_default_blocks_through_dispatcher(formulation):
    inputs, p = make_inputs(2, 3, 70, 70, 16, 16, torch.float32)
    run = lambda *a, **kw: plap_attention(*a, **kw, backend="triton")  # noqa: E731
    check(run, inputs, p, torch.float32, is_causal=True, formulation=formulation)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("shape", [(2, 5, 63, 63, 60, 60), (2, 2, 1, 45, 32, 16)], ids=str)
def test_triton_awkward_shapes(shape, formulation):
    inputs, p = make_inputs(*shape, torch.float32)
    check(triton_small_blocks, inputs, p, torch.float32, attn_mask=make_mask("padding", *shape[:4]),
          is_causal=True, formulation=formulation)  # fmt: skip


@needs_cuda
@needs_triton
@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("mask", [None, "padding"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 200, 200, 64, 64), (2, 5, 77, 200, 64, 64), (2, 3, 150, 150, 160, 160),
                                   (2, 3, 77, 200, 256, 256)], ids=str)  # fmt: skip
def test_triton_compiled_for_this_gpu(shape, dtype, is_causal, mask, formulation):
    """The kernels as models run them on a GPU: compiled, with this GPU's launch configuration (not the small test
    blocks), bfloat16 on tensor cores, over lengths that span several tiles and end in partial ones; head sizes 160
    and 256 in the largest bucket."""
    if triton_module.launch_config(dtype, shape[4], shape[5], torch.cuda.get_device_capability(DEVICE)) is None:
        pytest.skip(f"no {dtype} configuration at head size {shape[4]} on this GPU")
    inputs, p = make_inputs(*shape, dtype)
    run = lambda *a, **kw: plap_attention(*a, **kw, backend="triton")  # noqa: E731
    check(run, inputs, p, dtype, attn_mask=make_mask(mask, *shape[:4]), is_causal=is_causal, formulation=formulation)


@needs_cuda
@needs_triton
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("shape", [(2, 3, 40, 40, 64, 64), (1, 2, 2100, 2100, 64, 64)], ids=str)
def test_triton_on_a_gpu_that_is_not_the_current_one(shape):
    """A model split across GPUs in one process (``device_map="auto"``) calls attention on GPUs other than CUDA's
    current device, which Triton launches on: the exact passes alone of a small call, and both passes of a larger."""
    if triton_module.launch_config(torch.bfloat16, shape[4], shape[5], torch.cuda.get_device_capability(1)) is None:
        pytest.skip("the second GPU runs no bfloat16 configuration at head size 64")
    torch.cuda.set_device(0)
    inputs, p = make_inputs(*shape, torch.bfloat16, device=torch.device("cuda", 1))
    run = lambda *a, **kw: plap_attention(*a, **kw, backend="triton")  # noqa: E731
    check(run, inputs, p, torch.bfloat16, attn_mask=make_mask("padding", *shape[:4], device=inputs[0].device),
          is_causal=True)  # fmt: skip


# In a fresh process whose imports of triton fail: every file of the backend imports (remote code scans them), the
# kernels' annotations stay text, and the backend says why it cannot run.
WITHOUT_TRITON = """
import builtins
real_import = builtins.__import__

def no_triton(name, *args, **kwargs):
    if name == "triton" or name.startswith("triton."):
        raise ImportError(name)
    return real_import(name, *args, **kwargs)

builtins.__import__ = no_triton
import torch
import modeling_plat
from modeling_plat import plap_attention_triton, triton_backward, triton_forward
assert plap_attention_triton.triton is None
probe = torch.zeros(1, 1, 2, 2)
print(plap_attention_triton.triton_unsupported_reason(probe, probe, probe, p=(1.5,)))
"""


def test_triton_module_imports_without_triton():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, env=env,
                          cwd=Path(triton_module.__file__).parents[1], timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not installed" in done.stdout
