"""Padding-free packed rows: which document each token belongs to, from what transformers' collators pass.

``DataCollatorWithFlattening`` concatenates documents into one row and passes ``position_ids`` that restart at 0
for each document, plus, with ``return_flash_attn_kwargs=True``, ``cu_seq_lens_q/k`` (document boundaries). The
attention then keeps every token inside its document (``document_ids``), so that each document gets exactly the
logits it gets alone.
"""

import torch


def _from_boundaries(cu_seq_lens_q, cu_seq_lens_k, batch, length):
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: packed causal LM rows attend within one document")
    bounds = cu_seq_lens_q.to(torch.long)
    if batch != 1 or bounds.dim() != 1 or bounds.numel() < 2:
        raise ValueError(
            f"cu_seq_lens_q describes documents packed into one row: (documents + 1,) boundaries for a batch of 1; "
            f"got shape {tuple(cu_seq_lens_q.shape)} for a batch of {batch}"
        )
    if not torch.compiler.is_compiling():
        if int(bounds[0]) != 0 or int(bounds[-1]) != length or bool((bounds[1:] < bounds[:-1]).any()):
            raise ValueError(
                f"cu_seq_lens_q must rise from 0 to the row's length {length}; got {bounds.tolist()}"
            )
    positions = torch.arange(length, device=bounds.device)
    return torch.searchsorted(bounds[1:-1], positions, right=True)[None]  # (1, N)


def runs(starts):
    """(B, N) ids of runs of positions, counted from 0 in each row, from (B, N - 1) bools: whether each position
    after the first starts a run."""
    return torch.cat([starts.new_zeros(starts.shape[0], 1), starts], 1).cumsum(-1)


def packed_document_ids(position_ids=None, attention_mask=None, cu_seq_lens_q=None, cu_seq_lens_k=None, *, batch, length,
                 cache_given):
    """(B, N) document index of every new token of packed rows, or None when the rows are not packed.

    From ``cu_seq_lens_q`` when given, else from ``position_ids`` that restart at 0 at a real token with a real token
    before it in the row. Padding is never a document start: the first real token after left padding, and right
    padding (``generate`` gives padding position 0), also have position 0. A KV cache of packed rows would let
    later tokens attend across documents: with a cache from the caller (``cache_given``) packed rows are refused.
    Under torch.compile the restarts cannot be read on the host: rows with position_ids are then treated as
    possibly packed, and with a cache from the caller as not packed.
    """
    if cu_seq_lens_q is not None:
        if cache_given:
            raise ValueError("Packed rows (cu_seq_lens_q) cannot use a KV cache: its later tokens would attend across "
                             "documents; pass no cache")
        return _from_boundaries(cu_seq_lens_q, cu_seq_lens_k, batch, length)
    if position_ids is None or length == 1:
        return None
    position_ids = position_ids.expand(batch, length)
    restarts = position_ids[:, 1:] == 0  # (B, N - 1)
    if attention_mask is not None:
        real = attention_mask.bool()  # (B, past + N)
        real_so_far = real.long().cumsum(-1)[:, -length:]  # (B, N): real tokens up to each one, itself included
        restarts = restarts & real[:, -length + 1:] & (real_so_far[:, :-1] > 0)
    if torch.compiler.is_compiling():
        return None if cache_given else runs(restarts)
    if not bool(restarts.any()):
        return None
    if cache_given:
        raise ValueError(
            "position_ids restart at 0 inside a row (packed documents), which cannot use a KV cache: its later "
            "tokens would attend across documents; pass no cache"
        )
    return runs(restarts)  # (B, N)
