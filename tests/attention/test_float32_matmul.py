"""float32_baddbmm_: the squared-distance matmuls of the tiled backend stay float32-exact where CUDA
runs float32 matmuls in TF32 (allow_tf32, float32 matmul precision "high").

CUDA's TF32 cannot run here, so its effect is emulated: inputs rounded to TF32 by bit masking (tests/tf32.py),
products in float64. The split itself runs on any device; the CUDA dispatch is faked.
"""

import importlib

import pytest
import torch

from modeling_plat import plap_attention
from reference import reference_plap_attention
from tf32 import round_tf32, tf32_matmul

matmul_module = importlib.import_module("modeling_plat.float32_matmul")


def near_coinciding_values(seed=0):
    """(8, 64, 32) float32 values, each batch a cluster of points ~1e-3 apart around a point of norm ~6."""
    gen = torch.Generator().manual_seed(seed)
    centre = torch.randn(8, 1, 32, generator=gen)
    return centre + 1e-3 * torch.randn(8, 64, 32, generator=gen)


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def test_tf32_split_is_exact():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 10.0 ** torch.arange(-20, 20).repeat(25)
    high, low = matmul_module._tf32_split(x)
    assert torch.equal(round_tf32(high), high)  # the high part is a TF32 number
    assert torch.equal(high + low, x)  # and the low part holds the rest exactly
    assert (low.abs() <= x.abs() * 2.0**-10).all()


def test_split_distances_stay_at_float32_floor_under_tf32():
    """D2 = |x|^2 + |y|^2 - 2 x.y of near-coinciding points (D2 ~ 6e-5 against |x|^2 ~ 32). Measured: relative
    error of D2 8.5e-2 with float32 matmuls (the float32 floor of the expansion), 8.6e-2 with the split under
    emulated TF32, 5.3e1 with plain TF32."""
    values = near_coinciding_values()
    sq_norm = values.pow(2).sum(-1)
    exact = torch.cdist(values.double(), values.double()).pow(2)

    def distances(cross):
        return (sq_norm[:, :, None] + sq_norm[:, None, :] - 2 * cross).clamp_min(0)

    float32 = relative_error(distances(torch.bmm(values, values.transpose(1, 2))), exact)
    split = relative_error(distances(matmul_module._split_bmm(values, values.transpose(1, 2), tf32_matmul)), exact)
    plain_tf32 = relative_error(distances(tf32_matmul(values, values.transpose(1, 2))), exact)
    assert split <= 2 * float32
    assert plain_tf32 >= 100 * split


def test_cuda_tf32_setting_is_read(monkeypatch):
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert matmul_module._cuda_matmul_allows_tf32()
        torch.set_float32_matmul_precision("highest")
        assert not matmul_module._cuda_matmul_allows_tf32()
    finally:
        torch.set_float32_matmul_precision(previous)
    cpu = torch.zeros(2, 2)
    monkeypatch.setattr(matmul_module, "_cuda_matmul_allows_tf32", lambda: True)
    assert not matmul_module._tf32_may_round(cpu)  # CPU matmuls have no TF32


def test_tiled_through_the_split(monkeypatch):
    """Where TF32 would be on, the tiled backend takes its distances and their gradient's products through the
    split: forward and gradients still match the float64 reference. (The eager reference forms distances in
    float64, where TF32 plays no part.)"""
    monkeypatch.setattr(matmul_module, "_tf32_may_round", lambda tensor: tensor.dtype == torch.float32)
    calls = []
    split = matmul_module._split_bmm
    monkeypatch.setattr(matmul_module, "_split_bmm", lambda *a: calls.append(1) or split(*a))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8, generator=gen).requires_grad_() for _ in range(3))
    p = torch.tensor([1.5, 2.0, 2.5])
    out = plap_attention(q, k, v, p, is_causal=True, backend="tiled")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_plap_attention(*inputs64, p.double(), is_causal=True)
    ref_grads = torch.autograd.grad(ref, inputs64, torch.ones_like(ref))
    assert calls
    for ours, theirs in zip((out, *grads), (ref, *ref_grads)):
        assert relative_error(ours, theirs) < 1e-5


def tiled_errors_near_coinciding(monkeypatch=None, split=True):
    """Relative errors (out, dq, dk, dv) of the tiled backend against float64 on near-coinciding values, with
    every float32 matmul emulated as a TF32 tensor-core one when ``monkeypatch`` is given."""
    from modeling_plat.plap_attention_tiled import plap_attention_tiled

    if monkeypatch is not None:
        plain_bmm, plain_baddbmm_, plain_split = torch.bmm, torch.Tensor.baddbmm_, matmul_module._split_bmm

        def bmm(a, b, out=None):
            result = tf32_matmul(a, b) if a.dtype == torch.float32 else plain_bmm(a, b)
            return result if out is None else out.copy_(result)

        def baddbmm_(self, batch1, batch2, *, beta=1, alpha=1):
            if self.dtype != torch.float32:
                return plain_baddbmm_(self, batch1, batch2, beta=beta, alpha=alpha)
            product = tf32_matmul(batch1, batch2) * alpha
            return self.copy_(product) if beta == 0 else self.mul_(beta).add_(product)

        monkeypatch.setattr(torch, "bmm", bmm)
        monkeypatch.setattr(torch.Tensor, "baddbmm_", baddbmm_)
        monkeypatch.setattr(matmul_module, "_split_bmm", lambda a, b, bmm=None: plain_split(a, b, tf32_matmul))
        monkeypatch.setattr(matmul_module, "_tf32_may_round", lambda tensor: split and tensor.dtype == torch.float32)
    gen = torch.Generator().manual_seed(0)
    centre = torch.randn(2, 2, 1, 16, generator=gen)
    value = (centre + 1e-3 * torch.randn(2, 2, 24, 16, generator=gen)).requires_grad_()
    query, key = (torch.randn(2, 2, 24, 16, generator=gen).requires_grad_() for _ in range(2))
    p = torch.tensor([1.5, 2.5])
    out = plap_attention_tiled(query, key, value, p=tuple(p.tolist()), is_causal=True)
    grad_out = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (query, key, value), grad_out)
    if monkeypatch is not None:
        monkeypatch.undo()
    inputs64 = [t.detach().double().requires_grad_() for t in (query, key, value)]
    ref = reference_plap_attention(*inputs64, p.double(), is_causal=True)
    ref_grads = torch.autograd.grad(ref, inputs64, grad_out.double())
    return [relative_error(ours, theirs) for ours, theirs in zip((out, *grads), (ref, *ref_grads))]


def test_tiled_gradients_stay_at_float32_floor_under_tf32(monkeypatch):
    """The tiled backend's distance matmuls and the backward's products with Y ~ 1/(D2 + eps) (which cancel
    against rowsum / colsum(Y) v) go through the split. Measured dV error: float32 8.9e-5 (close pairs' distances by
    direct differences), emulated TF32 with the split 4.0e-4 (the other matmuls' TF32 rounding), plain TF32 0.17."""
    float32 = tiled_errors_near_coinciding()
    split = tiled_errors_near_coinciding(monkeypatch)
    plain = tiled_errors_near_coinciding(monkeypatch, split=False)
    assert float32[3] <= 1e-4
    assert split[3] <= 1e-3
    assert plain[3] >= 100 * split[3]


def test_tf32_setting_is_read_while_tracing():
    """torch.compile traces the TF32 query as a constant: no graph break, fullgraph works (the getter itself is
    opaque to Dynamo)."""
    compiled = torch.compile(lambda x: x + 1 if matmul_module._cuda_matmul_allows_tf32() else x - 1, fullgraph=True,
                             backend="eager")  # fmt: skip
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compiled(torch.zeros(2)).tolist() == [-1, -1]
    finally:
        torch.set_float32_matmul_precision(previous)
