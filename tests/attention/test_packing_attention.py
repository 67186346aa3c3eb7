"""Packed rows (document_ids) in every backend: each document gets exactly what it gets alone, and the float64
reference agrees on outputs and gradients; inputs that cannot be honoured are refused."""

import pytest
import torch

from device import DEVICE
from modeling_plat import plap_attention
from test_backends import TORCH_BACKENDS, check, make_inputs, needs_triton, triton_small_blocks

# Document lengths of two packed rows: not multiples of any tile, a one-token document, a long one.
LENGTHS = [[5, 11, 1, 20], [37]]


def document_ids(lengths, device=DEVICE):
    return torch.tensor([[doc for doc, n in enumerate(row) for _ in range(n)] for row in lengths], device=device)


BACKENDS = {name: run for name, run in TORCH_BACKENDS.items() if name != "decode"}  # decoding has no packing
BACKENDS["triton-small-blocks"] = needs_triton(triton_small_blocks)


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_match_the_reference(backend, is_causal, formulation):
    inputs, p = make_inputs(2, 3, 37, 37, 16, 16, torch.float32)
    check(BACKENDS[backend], inputs, p, torch.float32, is_causal=is_causal, formulation=formulation,
          document_ids=document_ids(LENGTHS))  # fmt: skip


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_document_gets_what_it_gets_alone(backend, formulation):
    (q, k, v), p = make_inputs(1, 3, 37, 37, 16, 16, torch.float32)
    run = BACKENDS[backend]
    packed = run(q, k, v, p, is_causal=True, formulation=formulation, document_ids=document_ids(LENGTHS[:1]))
    start = 0
    for length in LENGTHS[0]:
        piece = slice(start, start + length)
        alone = run(q[:, :, piece], k[:, :, piece], v[:, :, piece], p, is_causal=True, formulation=formulation)
        torch.testing.assert_close(packed[:, :, piece], alone, rtol=1e-5, atol=1e-5)
        start += length


def test_p2_heads_stay_inside_their_documents():
    (q, k, v), _ = make_inputs(1, 2, 37, 37, 16, 16, torch.float32)
    packed = plap_attention(q, k, v, 2.0, is_causal=True, document_ids=document_ids(LENGTHS[:1]))
    alone = plap_attention(q[:, :, 5:16], k[:, :, 5:16], v[:, :, 5:16], 2.0, is_causal=True)
    torch.testing.assert_close(packed[:, :, 5:16], alone)


@pytest.mark.parametrize(
    "ids_shape, ids_dtype, nq, message",
    [
        ((1, 37), torch.long, 3, "as many queries as keys"),
        ((1, 36), torch.long, 37, "must be \\(B, N\\)"),
        ((1, 37), torch.float32, 37, "integers"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "eager", "tiled", "triton", "decode"])
def test_packing_that_cannot_be_honoured_is_refused(ids_shape, ids_dtype, nq, message, backend):
    (q, k, v), p = make_inputs(1, 3, 37, 37, 16, 16, torch.float32)
    ids = torch.zeros(ids_shape, dtype=ids_dtype, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        plap_attention(q[:, :, -nq:], k, v, p, is_causal=True, document_ids=ids, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_ids_compare_as_values(backend):
    """A token attends to every token with its document id, also where that id comes back after another
    document (the reference's rule), and ids need not be small or sorted."""
    inputs, p = make_inputs(2, 3, 37, 37, 16, 16, torch.float32)
    ids = torch.tensor([[9] * 7 + [-4] * 12 + [9] * 18, [5] * 20 + [1000] * 17], device=DEVICE)
    check(BACKENDS[backend], inputs, p, torch.float32, is_causal=False, formulation="paper", document_ids=ids)
