"""Sliding windows inside the fused kernels: the query at key position x attends to the keys in (x - w, x], as
transformers defines the window. Outputs and every gradient against the float64 reference given the same window as
a mask, for windows shorter than, equal to and longer than the input, with key padding, packed rows, Nq < Nk, repeated
values, both passes and the exact pass alone, across tile borders (blocks of 16), and float32's head chunks."""

import pytest
import torch
from device import DEVICE
from reference import reference_plap_attention
from test_backends import TOLERANCE, TRITON_MISSING, make_inputs, make_mask, relative_error, triton_small_blocks

from modeling_plat import plap_attention_triton as triton_module

pytestmark = pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (pip install triton)")


def window_mask(num_queries, num_keys, window):
    """(Nq, Nk): causal, and keys in (x - window, x] of the query at key position x (bottom-right aligned)."""
    query_pos = torch.arange(num_queries, device=DEVICE)[:, None] + num_keys - num_queries
    key_pos = torch.arange(num_keys, device=DEVICE)[None, :]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def check_window(shape, window, dtype=torch.float32, mask=None, documents=None, two_passes=True, formulation="paper",
                 duplicates=False, monkeypatch=None):  # fmt: skip
    inputs, p = make_inputs(*shape, dtype, duplicates=duplicates)
    monkeypatch.setattr(triton_module, "ONE_PASS_PAIRS", 0 if two_passes else 2**62)
    attn_mask = make_mask(mask, *shape[:4])
    out = triton_small_blocks(*inputs, p, attn_mask=attn_mask, is_causal=True, sliding_window=window,
                              document_ids=documents, formulation=formulation)  # fmt: skip
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    allowed = window_mask(shape[2], shape[3], window)
    if attn_mask is not None:
        allowed = allowed & attn_mask
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference_plap_attention(*ref_inputs, p.double(), attn_mask=allowed, formulation=formulation,
                                   document_ids=documents)  # fmt: skip
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double())
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        if theirs.norm() == 0:  # a window of one key: one softmax term, no gradient through the scores
            error = (ours.double().norm() / ref_grads[2].norm()).item()  # rounding, against dv's size
        else:
            error = relative_error(ours, theirs)
        assert error <= TOLERANCE[dtype], (name, error)


@pytest.mark.parametrize("two_passes", [True, False])
@pytest.mark.parametrize("window", [1, 7, 16, 23, 45, 60])  # one key, shorter than a tile, a tile, ..., = N, > N
def test_window_against_reference(monkeypatch, window, two_passes):
    check_window((2, 3, 45, 45, 16, 16), window, two_passes=two_passes, monkeypatch=monkeypatch)


@pytest.mark.parametrize("formulation", ["paper", "euler"])
def test_window_with_padding_and_a_cache(monkeypatch, formulation):
    """Key padding, one sequence fully masked (rows without keys are zero), and Nq < Nk (bottom-right aligned)."""
    check_window((2, 3, 19, 50, 16, 24), 21, mask="padding", formulation=formulation, monkeypatch=monkeypatch)


def test_window_with_packed_rows(monkeypatch):
    documents = torch.tensor([[0] * 13 + [1] * 20 + [2] * 15, [4] * 48], device=DEVICE)
    check_window((2, 2, 48, 48, 16, 16), 17, documents=documents, monkeypatch=monkeypatch)


def test_window_with_repeated_values(monkeypatch):
    """Exact duplicates (D2 = 0 off the diagonal) inside and across the window's edge."""
    check_window((2, 3, 40, 40, 16, 16), 12, duplicates=True, monkeypatch=monkeypatch)


@pytest.mark.parametrize("two_passes", [True, False])
def test_window_in_float32_head_chunks(monkeypatch, two_passes):
    """float32 above head size 64, whose kernels take the products over the head sizes in chunks of columns
    (``head_chunk``): query and value sizes that end inside a chunk (96, 80), with a window, key padding, packed rows,
    repeated values and euler at once."""
    documents = torch.tensor([[0] * 13 + [1] * 20 + [2] * 15, [4] * 48], device=DEVICE)
    check_window((2, 2, 48, 48, 96, 80), 17, mask="padding", documents=documents, formulation="euler", duplicates=True,
                 two_passes=two_passes, monkeypatch=monkeypatch)  # fmt: skip


def test_window_visits_only_the_band(monkeypatch):
    """O(N w): with a window of 16 over 160 keys in blocks of 16, each query block's loop visits the tile of its
    window's lower edge and its diagonal tile, 19 tiles in all, where causal attention visits 1 + 2 + ... + 10 = 55;
    and dK/dV's loops visit as few query tiles."""
    from modeling_plat import triton_backward, triton_forward

    visits = {}

    def counted(module, name):
        tile = getattr(module, name)

        def count(*args, **kwargs):
            visits[name] = visits.get(name, 0) + 1
            return tile(*args, **kwargs)

        monkeypatch.setattr(module, name, count)

    if not triton_module.INTERPRETED:
        pytest.skip("counts the tiles that the interpreter runs")
    counted(triton_forward, "_forward_tile")
    counted(triton_backward, "_dkdv_tile")
    monkeypatch.setattr(triton_module, "ONE_PASS_PAIRS", 2**62)  # the exact pass alone: one launch per kernel
    inputs, p = make_inputs(1, 1, 160, 160, 16, 16, torch.float32)
    for window, tiles in ((None, 55), (16, 19)):
        visits.clear()
        out = triton_small_blocks(*inputs, p, is_causal=True, sliding_window=window)
        torch.autograd.grad(out, inputs, torch.ones_like(out))
        assert visits == {"_forward_tile": tiles, "_dkdv_tile": tiles}, (window, visits)
