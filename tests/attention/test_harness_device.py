"""The test harness builds everything on its inputs' device, checked without a GPU.

A tensor the harness makes on the CPU (a bare ``torch.ones(...)`` mask, a ``torch.tensor`` of positions) meets
inputs on the ``meta`` device in an elementwise operation and raises, as it would meet CUDA inputs on a GPU; a
host read (``.tolist()``, ``.item()``) of a meta tensor raises too. Meta tensors have shapes and no data, so these
checks cost milliseconds: they run the reference and the helpers that make inputs and masks, forward and backward.
"""

import pytest
import torch

from reference import reference_plap_attention
from test_attention import make_inputs as small_inputs
from test_attention import padding_mask
from test_backends import make_inputs, make_mask
from test_packing_attention import LENGTHS, document_ids

META = torch.device("meta")


def test_meta_catches_what_a_gpu_would():
    """The premise: a CPU tensor mixed with meta inputs fails, as with CUDA inputs ("same device")."""
    inputs = torch.zeros(2, 3, device=META)
    with pytest.raises(RuntimeError, match="device"):
        torch.ones(2, 3, dtype=torch.bool) & (inputs > 0)
    with pytest.raises(RuntimeError, match="device"):
        torch.where(torch.ones(2, 3, dtype=torch.bool), inputs, 0.0)
    with pytest.raises(NotImplementedError):
        inputs.tolist()


@pytest.mark.parametrize("formulation", ["paper", "euler", "noself", "selfweight"])
@pytest.mark.parametrize("mask", [None, "padding", "full"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("nq", [21, 50])  # a KV cache (Nq < Nk, bottom-right aligned) and square
def test_reference_and_backend_helpers_stay_on_the_inputs_device(nq, is_causal, mask, formulation):
    shape = (2, 3, nq, 50, 16, 24)
    (q, k, v), p = make_inputs(*shape, torch.float32, device=META)
    attn_mask = make_mask(mask, *shape[:4], device=META)
    assert all(t.device == META for t in (q, k, v, p)) and (attn_mask is None or attn_mask.device == META)
    out = reference_plap_attention(q, k, v, p, attn_mask=attn_mask, is_causal=is_causal, formulation=formulation)
    assert out.device == META and out.shape == (2, 3, nq, 24)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(g.device == META for g in grads)


def test_reference_with_document_ids_reads_nothing_on_the_host():
    (q, k, v), p = make_inputs(2, 3, 37, 37, 16, 16, torch.float32, device=META)
    ids = document_ids(LENGTHS, device=META)
    out = reference_plap_attention(q, k, v, p, is_causal=True, document_ids=ids)
    assert out.device == META


def test_attention_helpers_stay_on_the_inputs_device():
    q, k, v = small_inputs(duplicates=True, device=META)
    mask = padding_mask(2, 7, 7, device=META)
    out = reference_plap_attention(q, k, v, [1.1, 1.5, 2.0, 2.5, 3.0], attn_mask=mask, is_causal=True)
    assert out.device == META
