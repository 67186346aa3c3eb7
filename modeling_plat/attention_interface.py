"""p-LaT in transformers' own models: ``attn_implementation="plap"``.

Importing ``modeling_plat`` registers ``plap_attention_forward`` with transformers' ``AttentionInterface`` and
``plap_mask`` with its ``AttentionMaskInterface``, so that any model whose attention dispatches through the interface
(Llama, Qwen2/3, Mistral, Phi-3, Gemma, SmolLM, ViT, ...) runs eq. 12 in every attention layer::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="plap")

transformers keeps computing everything around the attention (rotary embeddings of every type, sliding-window and
chunked masks, caches, grouped-query heads); this module only replaces softmax(q k^T) v. p-LaT reads from the
model's own config, under ``PlatConfig``'s names: ``plap_p`` (one float, one per query head, or one list per layer;
the paper's mix when unset), ``plap_eps``, ``plap_formulation`` and ``plap_backend``. They are plain config
attributes, saved by ``save_pretrained``; ``attn_implementation`` is saved only where ``config.attn_implementation =
"plap"`` is set (``mark_plap``).
"""

import copy
import math
import weakref
from types import SimpleNamespace

import torch
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)

from .configuration_plat import PlatConfigBase, paper_p_mix
from .packing import packed_document_ids, runs
from .plap_dispatch import BACKENDS, FORMULATIONS, layer_attention

ATTN_IMPLEMENTATION = "plap"


def plap_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
              attention_mask=None, allow_is_causal_skip=True, **kwargs):  # fmt: skip
    """A boolean mask (True = may attend) for ``plap_attention_forward``, queries being the last keys.

    A plain causal or bidirectional pattern, or a causal sliding window, becomes None or a (B, 1, 1, Nk) key-padding
    mask, the module's ``is_causal`` and the ``sliding_window`` that transformers passes to the attention function
    adding the rest: the fused kernels take those, not a (B, 1, Nq, Nk) mask. A causal chunked pattern (Llama 4)
    becomes its chunks (``_chunk_mask``). Any other pattern (overlays, a chunked cache's multi-token steps) is
    transformers' own ``sdpa_mask``. p-LaT weighs each key by its value's
    distance to the query's own value, which it finds at the bottom-right diagonal: cross-attention, and a static
    cache (which hands back its whole fixed length, empty slots included), are refused.
    """
    if isinstance(q_offset, torch.Tensor) or q_offset + q_length != kv_offset + kv_length:
        raise ValueError(
            f"attn_implementation='plap' needs the {q_length} queries to be the last of the {kv_length} keys, each "
            "with its own value: cross-attention cannot run p-LaT, nor can a static cache (generate("
            "cache_implementation='static')); use a DynamicCache"
        )
    plain = mask_function in (causal_mask_function, bidirectional_mask_function)
    return (_pattern_mask if plain else _other_pattern_mask)(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, allow_is_causal_skip,
        **kwargs,
    )


def _pattern_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                  allow_is_causal_skip, **kwargs):  # fmt: skip
    """``plap_mask`` of a valid call: what ``mask_function`` is, and the mask that says it."""
    base = _without_packing(mask_function)
    plain = base in (causal_mask_function, bidirectional_mask_function)
    skip = allow_is_causal_skip or base is not mask_function  # transformers clears the flag for packed rows
    if skip and (plain or _is_sliding_window(base, kwargs.get("local_size"), kwargs.get("device"))):
        return _key_padding(attention_mask, kv_length, kv_offset)
    if skip and _is_chunked(base) and q_length in (1, kv_length):
        return _chunk_mask(mask_function, attention_mask, batch_size, q_length, kv_length, kv_offset,
                           kwargs.get("device"))
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)  # fmt: skip


# Telling the other patterns apart reads the closures of transformers' mask functions and evaluates them on the host,
# which dynamo does not trace: torch.compile runs it as one call outside its graphs (one graph break per mask made)
# rather than breaking at each step inside it.
_other_pattern_mask = torch.compiler.disable(_pattern_mask, reason="plap_mask reads the mask function's closures")


def _key_padding(attention_mask, kv_length, kv_offset):
    """(B, 1, 1, Nk) bool of the keys that are not padding, or None where every key is real."""
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # (B, kv_offset + Nk) or None
    if padding is not None:
        padding = padding[:, kv_offset : kv_offset + kv_length]  # a sliding cache's keys start at kv_offset
    if padding is None or (not torch.compiler.is_compiling() and bool(padding.all())):
        return None
    return padding[:, None, None, :]


def _is_chunked(mask_function):
    """Whether ``mask_function`` is transformers' causal chunked pattern: ``and_masks(chunked_overlay(size,
    left_padding), causal_mask_function)``, keys in the query's own chunk and not after it."""
    parts = _and_parts(mask_function)
    return len(parts) == 2 and parts[0].__qualname__.startswith("chunked_overlay.") and parts[1] is causal_mask_function


def _chunk_mask(mask_function, attention_mask, batch_size, q_length, kv_length, kv_offset, device):
    """A causal chunked pattern as a (B, 1, 1, Nk) mask. Within each chunk it is causal attention, as within a packed
    document: a chunk starts at each key that the query at its own position may not see from the key before it (the
    chunk size, each row's left padding and packed rows' documents all decide where, inside ``mask_function``).
    For as many queries as keys the mask holds each key's chunk, counted from 0 in each row, and -1 for padding:
    ``plap_attention_forward`` passes them as the document ids whose spans the kernels visit, so that the cost is
    that of the chunks, not of the causal square. For one query (decoding), the bool mask of the real keys in its
    chunk. None where every key is real and in one chunk (plain causal attention)."""
    padding = _key_padding(attention_mask, kv_length, kv_offset)
    keys = torch.arange(kv_offset + 1, kv_offset + kv_length, device=device)[None]  # (1, Nk - 1)
    rows = torch.arange(batch_size, device=device)[:, None]
    starts = ~mask_function(rows, 0, keys, keys - 1)  # (B, Nk - 1)
    if not torch.compiler.is_compiling() and not bool(starts.any()):
        return padding
    chunks = runs(starts)  # (B, Nk)
    if q_length == 1:
        same = chunks == chunks[:, -1:]
        return (same if padding is None else same & padding[:, 0, 0])[:, None, None, :]
    if padding is not None:
        chunks = chunks.masked_fill(~padding[:, 0, 0], -1)
    return chunks[:, None, None, :]


def _without_packing(mask_function):
    """The pattern of ``mask_function`` without transformers' packed-rows mask, or ``mask_function`` itself. From
    position_ids that restart at 0 transformers builds ``and_masks(remap_positions_for_packed_sequence(pattern,
    position_ids), packed_sequence_mask_function(ids))``: the pattern on each document's own positions, within the
    document, which is the pattern itself within each document of consecutive positions. Packed rows then reach the
    attention function as the position_ids (or cu_seq_lens) that transformers passes to every attention function,
    which ``plap_attention_forward`` turns into document ids, as FlashAttention's varlen path does."""
    parts = _and_parts(mask_function)
    if len(parts) != 2 or not parts[1].__qualname__.startswith("packed_sequence_mask_function."):
        return mask_function
    pattern = parts[0]
    if pattern.__qualname__.startswith("remap_positions_for_packed_sequence."):
        pattern = _closure_value(pattern, "mask_function")
    return pattern


def _and_parts(mask_function):
    """The mask functions that transformers' ``and_masks`` joined into ``mask_function``, or () for any other."""
    parts = _closure_value(mask_function, "mask_functions") if mask_function.__name__ == "and_mask" else None
    return tuple(parts or ())


def _closure_value(function, name):
    """The value ``function`` closes over under ``name``, or None."""
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    return cells[name].cell_contents if name in cells else None


def _is_sliding_window(mask_function, window, device=None):
    """Whether ``mask_function`` is transformers' causal sliding window of ``window`` keys, (x - window, x] for the
    query at x: probed at the window's edges, where a chunked pattern of that size (Llama 4) differs. Such a mask
    becomes a size: the models that build it pass ``sliding_window`` to their attention function, as FlashAttention
    needs (transformers' own flash_attention_mask likewise drops the pattern)."""
    if window is None or isinstance(window, torch.Tensor):
        return False
    query = 2 * window + 1
    probes = {query - window: False, query - window + 1: True, query: True, query + 1: False, window - 1: False}
    # One call on every probed key at once, broadcast as transformers' sdpa_mask calls mask functions, on the device
    # of the tensors they hold (a chunked pattern's left padding).
    zero = torch.tensor(0, device=device)
    allowed = mask_function(zero, zero, torch.tensor(query, device=device), torch.tensor(list(probes), device=device))
    return torch.as_tensor(allowed).broadcast_to((len(probes),)).tolist() == list(probes.values())


def _layer_p(plap_p, num_layers, num_heads, layer_idx):
    """p of one layer's heads as a tuple: PlatConfig's reading of ``plap_p`` (and its errors)."""
    if plap_p is None:
        return tuple(paper_p_mix(num_heads))
    table = PlatConfigBase.p_per_layer(
        SimpleNamespace(plap_p=plap_p, num_hidden_layers=num_layers, num_attention_heads=num_heads)
    )
    if layer_idx is None:
        if any(row != table[0] for row in table):
            raise ValueError(
                "plap_p gives each layer its own p, but this model's attention modules carry no layer_idx: give one "
                "p per head for all layers"
            )
        layer_idx = 0
    return tuple(table[layer_idx])


# PlatConfig's field names, and what p-LaT runs when a transformers config lacks them.
PLAP_FIELDS = {"plap_p": None, "plap_eps": 1e-6, "plap_formulation": "paper", "plap_backend": "auto"}


def _plap_fields(config):
    """(plap_p, plap_eps, plap_formulation, plap_backend) of a transformers config."""
    return tuple(getattr(config, name, default) for name, default in PLAP_FIELDS.items())


def _read_settings(module, num_heads):
    """(p per head of this layer, eps, formulation, backend) from ``module.config``, PlatConfig's field names."""
    config = module.config
    heads = getattr(config, "num_attention_heads", num_heads)
    if heads != num_heads:
        raise ValueError(
            f"config.num_attention_heads is {heads} but {type(module).__name__} computes {num_heads} query heads; "
            "p-LaT gives each query head its own p"
        )
    plap_p, eps, formulation, backend = _plap_fields(config)
    p = _layer_p(plap_p, getattr(config, "num_hidden_layers", 1), num_heads, getattr(module, "layer_idx", None))
    return p, eps, formulation, backend


# Each attention module's settings, beside a copy of the config fields they were read from. Reading them at every
# call cost ~9 us a layer (~1 us a config field through transformers' __getattribute__ hooks, then p's table): 1-2% of
# a decoding step of plat-llama-tiny's sizes on CPU.
_SETTINGS = weakref.WeakKeyDictionary()


def plap_settings(module, num_heads):
    """``_read_settings``, read again only when a field changes (in place too): a change to the config takes effect
    at the next call, as it would if every call read it."""
    if torch.compiler.is_compiling():
        return _read_settings(module, num_heads)  # dynamo runs it once while tracing, and guards on what it reads
    # PlatConfig's names are plain instance attributes (set by hand or from config.json), never aliased by
    # attribute_map: one dict lookup each.
    fields = vars(module.config)
    key = (num_heads, *(fields.get(name, default) for name, default in PLAP_FIELDS.items()))
    known = _SETTINGS.get(module)
    if known is None or known[0] != key:
        known = _SETTINGS[module] = (copy.deepcopy(key), _read_settings(module, num_heads))
    return known[1]


def _is_chunk_mask(attention_mask, is_causal, num_queries, num_keys):
    """Whether ``attention_mask`` is plap_mask's chunk of every key: (B, 1, 1, Nk) integers, a causal layer's, as
    many queries as keys."""
    integers = not attention_mask.is_floating_point() and attention_mask.dtype != torch.bool
    return (integers and is_causal and num_queries == num_keys and attention_mask.dim() == 4
            and attention_mask.shape[1:3] == (1, 1))  # fmt: skip


def _runs_of_both(first, second):
    """(B, N) ids of the runs of positions where neither (B, N) ``first`` nor ``second`` changes: the chunks of a
    cache's packed rows (transformers' mask then counts chunks from the row's start, not each document's)."""
    return runs((first[:, 1:] != first[:, :-1]) | (second[:, 1:] != second[:, :-1]))


def _is_cross_attention(module, is_causal):
    """Whether transformers built ``module`` to attend to another sequence, also where the lengths are equal: its own
    flag (GPT-2), its class (BERT's family: ``*CrossAttention``), or a decoder's attention that is not causal (BART's
    family, whose self- and cross-attention share one class). Instance attributes are read from ``vars``: a getattr
    that misses costs ~1 us (nn.Module's hook)."""
    fields = vars(module)
    return (fields.get("is_cross_attention", False) or type(module).__name__.endswith("CrossAttention")
            or (fields.get("is_decoder", False) and not is_causal))  # fmt: skip


def plap_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                           **kwargs):  # fmt: skip
    """transformers' attention-function contract: query (B, H, Nq, d), key and value (B, H_kv, Nk, d), a boolean mask
    broadcastable to (B, H, Nq, Nk) or None; returns (output (B, Nq, H, d), weights (B, H, Nq, Nk) or None)."""
    name = type(module).__name__
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"{name} soft-caps its attention logits (attn_logit_softcapping={kwargs['softcap']}), which p-LaT cannot "
            "apply: its softmax is computed inside the p-Laplacian kernels. Set config.attn_logit_softcapping = None "
            "to run p-LaT on this model"
        )
    for unsupported in ("s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{name} passes {unsupported} to its attention, which p-LaT cannot apply")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    chunks = None
    if attention_mask is not None and _is_chunk_mask(attention_mask, is_causal, num_queries, num_keys):
        chunks = attention_mask[:, 0, 0, :]  # (B, Nk), -1 for padding (plap_mask)
        attention_mask = (chunks >= 0)[:, None, None, :]
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(
            f"{name} built a {attention_mask.dtype} {tuple(attention_mask.shape)} attention mask; p-LaT takes "
            "boolean masks, or a causal layer's (B, 1, 1, N) chunk of every key (transformers' create_causal_mask, "
            "create_bidirectional_mask and create_chunked_causal_mask with attn_implementation='plap' make them)"
        )
    if _is_cross_attention(module, is_causal) or (not is_causal and num_queries != num_keys):
        raise ValueError(
            f"{name} attends from {num_queries} queries to {num_keys} other tokens (cross-attention): p-LaT weighs "
            "each key by its value's distance to the query's own value, which these queries do not have"
        )
    p, eps, formulation, backend = plap_settings(module, query.shape[1])
    head_dim = query.shape[-1]
    if scaling is not None and not math.isclose(scaling * math.sqrt(head_dim), 1.0, rel_tol=1e-12):
        query = query * (scaling * math.sqrt(head_dim))  # plap_attention scales by 1 / sqrt(d)
    # A mask with one row per query carries the causal pattern and any window itself (plap_mask); a key-padding one
    # does not: the window then comes as its size, as transformers passes it to every attention function.
    full_mask = attention_mask is not None and attention_mask.shape[-2] != 1
    sliding_window = None if full_mask or not is_causal else kwargs.get("sliding_window")
    documents = None
    if is_causal and not full_mask and num_queries == num_keys:  # packed rows: position_ids or cu_seq_lens (plap_mask)
        padding = attention_mask[:, 0, 0, :] if attention_mask is not None else None  # (B, Nk)
        documents = packed_document_ids(kwargs.get("position_ids"), padding, kwargs.get("cu_seq_lens_q"),
                                        kwargs.get("cu_seq_lens_k"), batch=query.shape[0], length=num_queries,
                                        cache_given=False)  # fmt: skip
    if chunks is not None:  # a chunk attends as a document does
        documents = chunks if documents is None else _runs_of_both(chunks, documents)
    out, weights = layer_attention(
        query, key, value, p=p, attn_mask=attention_mask, is_causal=is_causal and not full_mask,
        sliding_window=sliding_window, document_ids=documents, eps=eps, formulation=formulation, backend=backend,
        dropout=dropout, output_attentions=kwargs.get("output_attentions", False),
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), weights  # (B, Nq, H, d)


def check_plap_config(config):
    """Raise the ValueError that a forward with attn_implementation="plap" would raise for ``config``'s p-LaT fields."""
    layers, heads = getattr(config, "num_hidden_layers", 1), config.num_attention_heads
    plap_p, eps, formulation, backend = _plap_fields(config)
    for layer in range(layers):
        _layer_p(plap_p, layers, heads, layer)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"plap_eps must be a finite number > 0; got {eps!r}")
    for name, value, allowed in (("plap_formulation", formulation, tuple(FORMULATIONS)),
                                 ("plap_backend", backend, BACKENDS)):  # fmt: skip
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def mark_plap(config):
    """Make ``save_pretrained`` write ``"attn_implementation": "plap"`` into config.json, so that the checkpoint loads
    as p-LaT (and, without this package, fails to load rather than run softmax attention)."""
    config.attn_implementation = ATTN_IMPLEMENTATION
    return config
