"""Padding-free packed batches through the causal LM, built by transformers' own DataCollatorWithFlattening: each
document gets the logits it gets alone, the loss is the one of the documents alone, and what cannot be honoured
(a KV cache, boundaries that do not describe the row) is refused."""

import pytest
import torch
from device import DEVICE
from tiny import TEXT_SHAPES, lm
from torch.nn import functional as F
from transformers import DataCollatorWithFlattening, DynamicCache

from modeling_plat.cache_name import CACHE_NAME

# Not multiples of any tile; a one-token document; a long one.
LENGTHS = (5, 11, 1, 20)
DOCUMENTS = [torch.randint(2, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in LENGTHS]


def packed(boundaries):
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=boundaries, return_tensors="pt")
    batch = collator([{"input_ids": document} for document in DOCUMENTS])
    return {key: value.to(DEVICE) for key, value in batch.items() if key not in ("max_length_q", "max_length_k")}


@pytest.mark.parametrize("boundaries", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("backend", ["eager", "tiled", "triton"])
@pytest.mark.parametrize("shape", TEXT_SHAPES)
def test_each_packed_document_gets_its_logits_and_loss_alone(shape, backend, formulation, boundaries):
    if backend == "triton":
        pytest.importorskip("triton")
    model = lm(**TEXT_SHAPES[shape], plap_p=[1.5, 1.5, 2.5, 2.0], plap_formulation=formulation, plap_backend=backend)
    model = model.to(DEVICE)
    batch = packed(boundaries)
    with torch.no_grad():
        output = model(**batch)
        start, token_losses = 0, []
        for document in DOCUMENTS:
            ids = torch.tensor([document], device=DEVICE)
            alone = model(ids, labels=ids)
            torch.testing.assert_close(output.logits[:, start : start + len(document)], alone.logits)
            token_losses.append(F.cross_entropy(alone.logits[0, :-1], ids[0, 1:], reduction="sum"))
            start += len(document)
    assert getattr(output, CACHE_NAME) is None  # a cache of packed rows would attend across documents
    expected = torch.stack(token_losses).sum() / (sum(LENGTHS) - len(LENGTHS))
    torch.testing.assert_close(output.loss, expected)


def test_without_packing_awareness_documents_would_attend_across():
    """The property the test above checks is not trivial: the same row as one sequence differs."""
    model = lm(plap_p=[1.5, 1.5, 2.5, 2.0]).to(DEVICE)
    batch = packed(False)
    with torch.no_grad():
        as_one = model(batch["input_ids"]).logits
        as_documents = model(**batch).logits
    second = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])
    assert (as_one[:, second] - as_documents[:, second]).abs().max() > 1e-3


def test_packed_rows_with_a_cache_are_refused():
    model = lm().to(DEVICE)
    batch = packed(False)
    with pytest.raises(ValueError, match="packed documents.*KV cache"):
        model(**batch, cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="cu_seq_lens_q.*KV cache"):
        model(**packed(True), cache=DynamicCache(config=model.config))


@pytest.mark.parametrize(
    "bounds, message",
    [([0, 5, 16, 36], "rise from 0 to the row's length 37"), ([0, 16, 5, 37], "rise from 0"),
     ([37], "boundaries for a batch of 1")],
)
def test_boundaries_that_do_not_describe_the_row_are_refused(bounds, message):
    batch = packed(True)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        lm().to(DEVICE)(**batch)


def test_left_padding_is_not_packing():
    """Left padding also starts a row's positions at 0 after padding: not a document boundary."""
    model = lm(plap_p=[1.5, 1.5, 2.5, 2.0]).to(DEVICE)
    ids = torch.tensor([[0, 0, 7, 8, 9, 10]], device=DEVICE)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]], device=DEVICE)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits[:, 2:]
        alone = model(ids[:, 2:]).logits
    torch.testing.assert_close(padded, alone)
