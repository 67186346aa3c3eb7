"""The fused kernels' matmul precision as a GPU computes it, emulated under the Triton interpreter on CPU.

The interpreter multiplies every tl.dot exactly (and cannot multiply bfloat16 at all). Here its dot is
replaced by one that rounds as tensor cores do (``emulated_create_dot``): half inputs multiplied exactly,
float32 inputs rounded to TF32 under input_precision="tf32", split into TF32 parts under "tf32x3"; and float32 ->
bfloat16 conversions round to nearest, as on a GPU. The kernels run unchanged, so these tests check which precision
each of their matmuls asks for.
"""

import numpy as np
import pytest
import torch

from modeling_plat import plap_attention_triton as triton_module
from modeling_plat import triton_backward, triton_configs
from modeling_plat.plap_attention_tiled import plap_attention_tiled
from reference import reference_plap_attention
from test_backends import check, make_inputs, make_mask, relative_error, run_triton
from tf32 import round_tf32

pytestmark = pytest.mark.skipif(
    not triton_module.INTERPRETED, reason="emulates GPU matmuls under the Triton interpreter (CPU only)"
)

if triton_module.INTERPRETED:
    import triton
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    @triton.jit
    def float32_row_sums(sums, a):
        """``sums`` (of either shape ``row_sums_init`` makes) + rowsum(a) in float32."""
        if len(sums.shape) == 2:
            sums += tl.sum(a, 1)[:, None]
        else:
            sums += tl.sum(a, 1)
        return sums

    @triton.jit
    def plain_tf32_dot(a, b, acc, sums, EXACT: tl.constexpr, SUMS_BY_MATMUL: tl.constexpr):
        """What the kernels did before: the distance-gradient matmuls in plain TF32, row sums in float32."""
        return tl.dot(a, b.to(tl.float32), acc, input_precision="tf32"), float32_row_sums(sums, a)

    exact_dot = triton_backward.exact_dot

    @triton.jit
    def three_bfloat16_parts(a, b, acc, sums, EXACT: tl.constexpr, SUMS_BY_MATMUL: tl.constexpr):
        """The distance gradient split as the exact passes split it, in both passes."""
        return exact_dot(a, b, acc, sums, True, SUMS_BY_MATMUL)

    @triton.jit
    def rounded_against_float32_sums(a, b, acc, sums, EXACT: tl.constexpr, SUMS_BY_MATMUL: tl.constexpr):
        """The distance gradient rounded to bfloat16 for the matmul, its row sums from the float32 values."""
        return tl.dot(a.to(tl.bfloat16), b, acc), float32_row_sums(sums, a)


def _as_float64(handle):
    if handle.dtype == tl.bfloat16:  # the interpreter keeps bfloat16 as its uint16 bits
        return torch.from_numpy(handle.data.astype(np.int32) << 16).view(torch.float32).double()
    return torch.from_numpy(handle.data.astype(np.float32)).double()


def emulated_create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
    x, y = _as_float64(a), _as_float64(b)
    if a.dtype == tl.float32 and input_precision == ir.INPUT_PRECISION.TF32:
        product = round_tf32(x).double() @ round_tf32(y).double()
    elif a.dtype == tl.float32 and input_precision == ir.INPUT_PRECISION.TF32x3:
        x_high, y_high = round_tf32(x).double(), round_tf32(y).double()
        x_low, y_low = round_tf32(x - x_high).double(), round_tf32(y - y_high).double()
        product = x_high @ y_high + x_high @ y_low + x_low @ y_high
    else:
        product = x @ y
    result = product.float().numpy() + acc.data
    return interpreter.TensorHandle(result.astype(acc.data.dtype), acc.dtype.scalar)


def emulated_cast(cast):
    """The interpreter's cast, except float32 -> bfloat16 rounded to nearest even as a GPU's conversion does (the
    interpreter truncates, twice the error of the kernels' bfloat16 stores)."""

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.asarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    return cast_impl


@pytest.fixture
def gpu_dots(monkeypatch):
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", emulated_create_dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl",
                        emulated_cast(interpreter.InterpreterBuilder.cast_impl))  # fmt: skip


def run_kernels(*args, **kwargs):
    return run_triton(*args, **kwargs, blocks=(16, 16))


@pytest.mark.parametrize("sums", ["matmul", "in each thread"])
@pytest.mark.parametrize("passes", ["first and exact", "exact alone"])
@pytest.mark.parametrize("formulation", ["paper", "euler"])
def test_bfloat16_kernels_match_reference(gpu_dots, monkeypatch, formulation, passes, sums):
    """bfloat16, which the plain interpreter cannot run: outputs and gradients within the half tolerance, from each
    kernel's two passes (calls above ONE_PASS_PAIRS) and from its exact pass alone (every block flagged), with the
    distance gradient's row sums from a matmul against ones or summed in each thread (``sums_by_matmul``)."""
    monkeypatch.setattr(triton_module, "ONE_PASS_PAIRS", 0 if passes == "first and exact" else 2**62)
    config = triton_configs.INTERPRETER_CONFIG
    config = triton_configs.LaunchConfig(*(kernel._replace(sums_by_matmul=sums == "matmul") for kernel in config))
    run = lambda *args, **kwargs: run_kernels(*args, **kwargs, config=config)  # noqa: E731
    shape = (2, 2, 17, 33, 16, 24)
    inputs, p = make_inputs(*shape, torch.bfloat16)
    check(run, inputs, p, torch.bfloat16, attn_mask=make_mask("padding", *shape[:4]), is_causal=True,
          formulation=formulation)  # fmt: skip


# Values that close (relative) are as close as each half type can hold them apart without coinciding.
CLUSTER_SCALE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def value_gradient_error(run, dtype):
    """Relative error of dV against the float64 reference for a cluster of near-coinciding values, p = 1.5 and 2.5,
    paper formulation: their distance gradient Gd ~ 1 / (D2 + eps) is large and its terms rowsum(Gd) v_x - Gd V
    cancel almost exactly. (Exact duplicates coincide: no gradient through D2, nothing to cancel.)"""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))
    v[:, :, 1:8] = v[:, :, :1] * (1 + CLUSTER_SCALE[dtype] * torch.randn(1, 2, 7, 16, generator=gen))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    return dv_error(run, q, k, v, torch.randn(1, 2, 24, 16, generator=gen))


def dv_error(run, q, k, v, grad_out):
    """Relative error of dV of ``run`` at p = 1.5 and 2.5 against the float64 reference's, for the output gradient
    ``grad_out`` (cast to the output's dtype for ``run``)."""
    p = torch.tensor([1.5, 2.5])
    out = run(q, k, v, p)
    grad_v = torch.autograd.grad(out, v, grad_out.to(out.dtype))[0]
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_plap_attention(*ref_inputs, p.double())
    return relative_error(grad_v, torch.autograd.grad(ref, ref_inputs[2], grad_out.double())[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_distance_gradient_stays_at_float32_floor(gpu_dots, monkeypatch, dtype):
    """The distance-gradient matmuls (float32 Gd against half-precision values) split Gd into parts: three bfloat16
    parts against bfloat16 in the exact passes, which these near-coinciding values take, two TF32 parts against
    float16. Measured dV errors, bfloat16 / float16: tiled backend in float32 (the float32 floor) 1.5e-3 / 1.8e-4;
    kernels 2.2e-3 / 3.7e-4; the same matmuls in plain TF32 1.8e-2 / 5.0e-2."""
    def tiled_float32(q, k, v, p):
        return plap_attention_tiled(q.float(), k.float(), v.float(), p=tuple(p.tolist()))

    floor = value_gradient_error(tiled_float32, dtype)
    kernels = value_gradient_error(run_kernels, dtype)
    monkeypatch.setattr(triton_backward, "exact_dot", plain_tf32_dot)
    plain_tf32 = value_gradient_error(run_kernels, dtype)
    assert kernels <= 4 * floor
    assert plain_tf32 >= 5 * kernels


def spread_value_gradient_error(run, spread):
    """Relative error of dV against the float64 reference when every value is within ``spread`` (relative, per
    coordinate) of one: pairs about 4 * spread |v| apart, amplifying the distance gradient's rounding by ~1 / (4
    spread) where rowsum(Gd) v_x - Gd V cancels. dU is bfloat16 for both, so that only the computation differs."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))
    v = v[:, :, :1] * (1 + spread * torch.randn(1, 2, 24, 16, generator=gen))
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    return dv_error(run, q, k, v, torch.randn(1, 2, 24, 16, generator=gen).to(torch.bfloat16))


def test_first_pass_distance_gradient_rounded_to_bfloat16(gpu_dots, two_passes, monkeypatch):
    """The first passes round Gd to bfloat16 and take rowsum(Gd) from the same rounded values, the exact passes split
    Gd into three parts (float32's 24 bits): values spread 0.15 around one (no close pair: no block flagged) and 0.1
    (some blocks flagged, which the exact passes take) give dV within 1% of the error of three parts everywhere
    (2.47e-3 and 2.18e-3, about dV's own bfloat16 rounding). The same rounding against float32 row sums, whose
    cancellation against Gd V multiplies it, makes the error 1.2x and 1.6x."""
    flags, run, exact_dot_of_kernels = [], triton_module._run, triton_backward.exact_dot

    def record_flags(launch, query, value):
        run(launch, query, value)
        if launch.kernel.__name__ == "plap_forward_kernel" and bool(launch.meta["PASS"]):  # what all the passes follow
            flags.append(sum(int(a.sum()) for a in [a for a in launch.args if isinstance(a, torch.Tensor)][-2:]))
        # (each p's first pass zeroes its own heads' key tiles: complete after the last p's exact pass)

    monkeypatch.setattr(triton_module, "_run", record_flags)
    for spread, flagged in ((0.15, False), (0.1, True)):
        flags.clear()
        monkeypatch.setattr(triton_backward, "exact_dot", exact_dot_of_kernels)
        first = spread_value_gradient_error(run_kernels, spread)
        assert len(flags) == 2 and bool(flags[-1]) == flagged, flags  # the exact passes of p = 1.5, then 2.5
        monkeypatch.setattr(triton_backward, "exact_dot", three_bfloat16_parts)
        three = spread_value_gradient_error(run_kernels, spread)
        monkeypatch.setattr(triton_backward, "exact_dot", rounded_against_float32_sums)
        float32_sums = spread_value_gradient_error(run_kernels, spread)
        assert first <= 1.02 * three and float32_sums >= 1.15 * three, (spread, first, three, float32_sums)


def test_float32_kernels_match_reference_under_gpu_dots(gpu_dots):
    """float32 inputs: every matmul is tf32x3, so that TF32 rounding does not cost float32 accuracy."""
    shape = (2, 2, 17, 33, 16, 24)
    inputs, p = make_inputs(*shape, torch.float32)
    check(run_kernels, inputs, p, torch.float32, is_causal=True, formulation="paper")


def gpu_configurations():
    """(dtype, head size, LaunchConfig) of every distinct configuration the GPUs launch, at a head size of its
    bucket that is not a power of two. By default 9.x's at 64, float32's at 16 and the 8.x tiles of head size 256
    (which 12.x and unknown GPUs run too) at 160; the others with ``-m slow``."""
    default = {(9, "half", 64), (8, "float32", 16), (8, "half", 256)}
    seen = {}
    for (generation, kind), table in triton_configs.CONFIGS.items():
        for bucket, config in table.items():
            # The interpreter's own float16 stands in for both half types: only the tiling is checked here.
            dtype = torch.float32 if kind == "float32" else torch.float16
            marks = () if (generation, kind, bucket) in default else pytest.mark.slow
            seen.setdefault((dtype, config), pytest.param(dtype, bucket * 5 // 8, config, marks=marks))
    return list(seen.values())


@pytest.mark.parametrize("dtype, head_dim, config", gpu_configurations(), ids=str)
def test_gpu_launch_configurations(dtype, head_dim, config):
    """Each kernel has its own blocks on a GPU (dkdv a tall key block, dq and the forward a tall query block):
    outputs and gradients with those blocks, across tile borders, Nq < Nk, causal and padded."""
    shape = (1, 2, 150, 170, head_dim, head_dim)
    inputs, p = make_inputs(*shape, dtype)
    run = lambda *args, **kwargs: run_triton(*args, **kwargs, config=config)  # noqa: E731
    check(run, inputs, p, dtype, attn_mask=make_mask("padding", *shape[:4]), is_causal=True, formulation="euler")


def perturbed(function, relative=0.0, absolute=0.0):
    """``function`` with errors of the given size and a pseudo-random sign, larger than the GPU's approximate
    instructions have (ex2/lg2/sqrt/rsqrt.approx.f32: relative ~2^-22, lg2 absolute ~2^-22)."""
    signs = np.random.default_rng(0)

    def approximate(self, arg):
        exact = function(arg.data)
        noise = signs.choice(np.array([-1.0, 1.0], dtype=exact.dtype), size=exact.shape)
        return interpreter.TensorHandle((exact * (1 + noise * relative) + noise * absolute).astype(exact.dtype),
                                        arg.dtype.scalar)  # fmt: skip

    return approximate


@pytest.mark.parametrize("formulation", ["paper", "euler"])
def test_approximate_special_functions_keep_float32_accuracy(gpu_dots, monkeypatch, formulation):
    """The kernels' exp2, log2, sqrt and rsqrt are the hardware's approximate ones on a GPU (the interpreter
    computes them exactly): with every result off by 2^-21 the outputs and gradients of every class of the
    power (p = 1.5, 2.5 and others, P_MIX) stay within the float32 tolerance of the float64 reference."""
    builder = interpreter.InterpreterBuilder
    monkeypatch.setattr(builder, "create_exp2", perturbed(np.exp2, relative=2**-21))
    monkeypatch.setattr(builder, "create_log2", perturbed(np.log2, absolute=2**-21))
    monkeypatch.setattr(builder, "create_sqrt", perturbed(np.sqrt, relative=2**-21))
    monkeypatch.setattr(builder, "create_rsqrt", perturbed(lambda x: 1 / np.sqrt(x), relative=2**-21))
    shape = (2, 5, 17, 33, 16, 24)
    inputs, p = make_inputs(*shape, torch.float32)
    check(run_kernels, inputs, p, torch.float32, attn_mask=make_mask("padding", *shape[:4]), is_causal=True,
          formulation=formulation)  # fmt: skip
