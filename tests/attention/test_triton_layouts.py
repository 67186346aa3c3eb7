"""The fused kernels take q, k, v, the output and the gradients in the layouts a model gives them.

A model's attention layer views its projections (B, N, H * d) as (B, N, H, d) transposed to (B, H, N, d). The kernels
read such views by their strides (``kernel_layout``), write the output in the queries' order, so that the model's
reshape back to (B, N, H * dv) is a view (``output_like``), each gradient in its input's layout, and read dU by the
output's strides (``in_layout_of``). Here the same values in both layouts give the same results (the same bits under the
Triton interpreter), each tensor in its layout, and a PlatAttention layer's forward + backward copies nothing.
"""

import pytest
import torch
from device import DEVICE, TRITON_HALF
from test_backends import TOLERANCE, TRITON_MISSING, make_inputs, make_mask, relative_error, triton_small_blocks
from torch.utils._python_dispatch import TorchDispatchMode

from modeling_plat import PlatConfig
from modeling_plat import plap_attention_triton as triton_module
from modeling_plat.modeling_plat import PlatAttention
from modeling_plat.plap_attention_triton import in_layout_of, kernel_layout, output_like

needs_triton = pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (pip install triton)")
DOCUMENTS = [[0] * 13 + [1] * 20 + [2] * 15, [4] * 48]


def tokens_major(tensor):
    """The same values as a (B, H, N, C) view of (B, N, H, C) memory, as a projection's view is, requiring grad."""
    return tensor.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()


def run(inputs, p, grad_out, **kwargs):
    out = triton_small_blocks(*inputs, p, **kwargs)
    return out, torch.autograd.grad(out, inputs, grad_out)


def assert_same(actual, expected, dtype):
    """Bit for bit under the interpreter; on a GPU the values' norms, one ATen reduction over either layout, may round
    their last bit differently."""
    if DEVICE.type == "cpu":
        assert torch.equal(actual, expected), (actual - expected).abs().max()
    else:
        assert relative_error(actual, expected) <= TOLERANCE[dtype] / 10


@needs_triton
@pytest.mark.parametrize(
    "shape, dtype, kwargs, two_passes, grad_layout",
    [
        ((2, 3, 33, 33, 16, 16), torch.float32, dict(is_causal=True, duplicates=True), True, "output's"),
        ((2, 2, 17, 33, 16, 24), TRITON_HALF, dict(mask="padding", formulation="euler"), False, "contiguous"),
        ((1, 2, 40, 40, 96, 80), torch.float32, dict(is_causal=True, sliding_window=17, duplicates=True), True,
         "output's"),
        ((2, 2, 48, 48, 16, 16), torch.float32, dict(documents=DOCUMENTS, formulation="euler"), True, "output's"),
    ],
    ids=["causal-repeated-values", "padding-cache-euler-exact-alone", "float32-head-chunks-window", "packed-rows"],
)  # fmt: skip
def test_projection_views_match_contiguous_inputs(monkeypatch, shape, dtype, kwargs, two_passes, grad_layout):
    """Both passes and the exact pass alone, close pairs' direct differences (repeated values), Nq < Nk (the queries'
    own values from row Nk - Nq on), float32's head chunks (rows read from memory in each tile), packed rows; dU in the
    output's layout (as a model's backward passes it) or contiguous (copied into the output's)."""
    monkeypatch.setattr(triton_module, "ONE_PASS_PAIRS", 0 if two_passes else 2**62)
    kwargs = dict(kwargs)
    inputs, p = make_inputs(*shape, dtype, duplicates=kwargs.pop("duplicates", False))
    kwargs["attn_mask"] = make_mask(kwargs.pop("mask", None), *shape[:4])
    documents = kwargs.pop("documents", None)
    kwargs["document_ids"] = None if documents is None else torch.tensor(documents, device=DEVICE)
    grad_out = torch.randn(shape[0], shape[2], shape[1], shape[5], generator=torch.Generator().manual_seed(3))
    grad_out = grad_out.to(DEVICE, dtype).transpose(1, 2)  # (B, H, Nq, dv) of (B, Nq, H, dv) memory
    if grad_layout == "contiguous":
        grad_out = grad_out.contiguous()
    contiguous_out, contiguous_grads = run(inputs, p, grad_out.contiguous(), **kwargs)
    strided = [tokens_major(tensor) for tensor in inputs]
    out, grads = run(strided, p, grad_out, **kwargs)
    assert contiguous_out.is_contiguous() and out.transpose(1, 2).is_contiguous()  # the queries' order
    assert_same(out, contiguous_out, dtype)
    for grad, contiguous_grad, tensor in zip(grads, contiguous_grads, strided):
        assert grad.stride() == tensor.stride() and contiguous_grad.is_contiguous()
        assert_same(grad, contiguous_grad, dtype)


def test_the_kernels_copy_only_what_they_cannot_read_in_place():
    projection = torch.empty(2, 40, 3 * 64, device="meta")
    view = projection.view(2, 40, 3, 64).transpose(1, 2)
    assert kernel_layout(view) is view
    assert output_like(view, view[..., :32]).transpose(1, 2).is_contiguous()  # tokens-major like the queries
    contiguous = torch.empty(2, 3, 40, 64, device="meta")
    assert kernel_layout(contiguous) is contiguous and output_like(contiguous, contiguous).is_contiguous()
    one_head = torch.empty(2, 40, 1, 64, device="meta").transpose(1, 2)  # size-1 dims' strides do not matter
    assert kernel_layout(one_head) is one_head
    fused = torch.empty(2, 40, 3 * 3 * 64, device="meta")  # q, k and v sliced from one projection: not dense
    sliced = fused[..., : 3 * 64].view(2, 40, 3, 64).transpose(1, 2)
    every_other_column = torch.empty(2, 3, 40, 128, device="meta")[..., ::2]
    broadcast = torch.empty(1, 3, 40, 64, device="meta").expand(2, 3, 40, 64)
    # Tokens-major rows of all heads past int32 offsets inside one (batch, head): a contiguous copy, which fits.
    long_rows = torch.empty(1, 2**21, 32, 64, device="meta").transpose(1, 2)
    for tensor in (sliced, every_other_column, broadcast, long_rows):
        copy = kernel_layout(tensor)
        assert copy is not tensor and copy.is_contiguous()
    assert output_like(long_rows, long_rows).is_contiguous()


def test_the_gradient_of_the_output_is_read_in_the_outputs_layout():
    out = torch.empty(2, 5, 3, 8).transpose(1, 2)
    same = torch.randn(2, 5, 3, 8).transpose(1, 2)
    assert in_layout_of(out, same) is same
    for other in (torch.randn(2, 3, 5, 8), torch.randn(1, 1, 1, 8).expand(2, 3, 5, 8)):
        copied = in_layout_of(out, other)
        assert copied.stride() == out.stride() and torch.equal(copied, other)


class CopyCounter(TorchDispatchMode):
    """The ATen operations that copy a tensor into another layout (``contiguous`` and ``reshape`` of a strided view
    clone, ``in_layout_of`` copies), outside the kernels' launches (the interpreter copies their arguments)."""

    def __init__(self):
        super().__init__()
        self.copies = []
        self.launching = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.launching and func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            self.copies.append(func)
        return func(*args, **(kwargs or {}))


@needs_triton
def test_a_plat_attention_layer_copies_nothing(monkeypatch):
    """Forward + backward of a model's attention layer through the kernels: its q, k and v are views of the
    projections, its output reshaped into the output projection's input, and its gradients flow back the same way."""
    config = PlatConfig(hidden_size=2 * 16, num_attention_heads=2, num_hidden_layers=1, plap_p=[1.5, 2.5],
                        plap_backend="triton")  # fmt: skip
    torch.manual_seed(0)
    attention = PlatAttention(config, 0, is_causal=True).to(DEVICE)
    hidden = torch.randn(2, 24, 2 * 16, device=DEVICE, requires_grad=True)
    counter, launch = CopyCounter(), triton_module._run
    launches = []

    def counted_launch(*args):
        counter.launching = True
        try:
            launch(*args)
        finally:
            counter.launching = False
        launches.append(args[0].kernel)

    monkeypatch.setattr(triton_module, "_run", counted_launch)
    with counter:
        out = attention(hidden)[0]
        out.backward(torch.ones_like(out))
    assert len(launches) == 3  # the kernels ran: forward, dq, dk/dv
    assert counter.copies == []
    assert torch.isfinite(hidden.grad).all()
