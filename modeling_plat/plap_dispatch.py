"""p-Laplacian attention: the input checks and the choice of backend. The maths is in ``plap_attention_reference``.

Backends, each computing ``plap_attention_reference`` (tests compare every one with a float64 reference):
    eager   the reference itself: (B, H, Nq, Nk) memory, any input, the only one that differentiates p.
    decode  plap_attention_decode.py: a few new queries against a KV cache, in a handful of kernels.
    tiled   plap_attention_tiled.py: PyTorch tiles with an online softmax, O(N) extra memory.
    triton  plap_attention_triton.py: fused kernels for CUDA (or CPU under TRITON_INTERPRET=1).
Each backend states why it cannot run an input (``unsupported_reason``); "auto" takes the first backend of a
preference list (``preference``) that has no objection, once per group of heads. Heads with p = 2 are softmax
attention in every formulation and run through ``scaled_dot_product_attention`` whatever the backend.
Nothing here reads a tensor on the host: p is static data, so compiled graphs do not break and GPUs do not wait.
The choice depends on the inputs' shapes, dtypes and masks and on the facts of the machine (``Platform``), which
are read once per call outside what torch.compile traces: a traced call chooses exactly what an eager call does. Eager
calls keep their checks and choices by those facts (a model asks the same questions at every step).
On CUDA, "auto" never leaves the fused kernels silently: it logs once per reason what it runs instead, and why.
"""

import functools
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.utils import logging

from .eager_cache import eager_cache
from .head_runs import head_runs, one_value
from .plap_attention_decode import DECODE_MAX_QUERIES, decode_unsupported_reason, plap_attention_decode
from .plap_attention_decode import FORMULATIONS as DECODE_FORMULATIONS
from .plap_attention_tiled import FORMULATIONS as TILED_FORMULATIONS
from .plap_attention_tiled import plap_attention_tiled
from .plap_attention_reference import (
    FORMULATIONS, allowed_positions, plap_attention_eager, sliding_window_positions,
)  # fmt: skip
from .triton_configs import device_capability

# On CPU the eager backend beats the tiled one up to this many scores (B * H * Nq * Nk of the heads with p != 2)
# per intra-op thread: its few large kernels cost less than the tiled loop's per-call overhead. Re-derive with
# `python benchmarks/bench_attention.py` (crossovers per machine in docs/performance.md).
EAGER_MAX_SCORES_PER_THREAD_CPU = 65536
# On CUDA, where the kernels refuse an input, the eager backend ran forward + backward 21-36x faster than the tiled one
# on an H200 (bfloat16, d = 64, a general mask, 512-8k tokens: section "fallback" of
# benchmarks/results/gpu_check-h200-2026-11-27-ef73312.json), at a peak of 38 bytes per score (B * H * Nq * Nk)
# against the tiled one's O(N). Eager runs while that peak takes at most this share of the GPU's memory (a model keeps
# each layer's weights for its backward), tiled above.
EAGER_MAX_MEMORY_SHARE_CUDA = 1 / 16
EAGER_PEAK_BYTES_PER_SCORE = 38

logger = logging.get_logger(__name__)


class Platform(NamedTuple):
    """What the choice of backend knows of the machine, besides the inputs themselves."""

    device_type: str  # "cuda", "cpu", ...: the kind of device the inputs are on
    capability: tuple[int, int] | None  # the CUDA compute capability (major, minor); None elsewhere
    threads: int  # intra-op threads of the CPU
    triton_interpreted: bool  # TRITON_INTERPRET=1: CPU tensors may run the Triton kernels, interpreted
    memory: int | None = None  # the CUDA device's total memory in bytes; None elsewhere


# Constant while torch.compile traces (Dynamo runs it once and keeps the result): the CUDA queries and the thread
# count are host calls that a trace could not contain, and the traced choice must be the eager one.
@torch.compiler.assume_constant_result
def device_platform(device_type, device_index):
    """The ``Platform`` of a device, e.g. ``device_platform(query.device.type, query.device.index)``."""
    capability, memory = None, None
    if device_type == "cuda":
        capability, memory = device_capability(device_index), _cuda_memory(device_index)
    return Platform(device_type, capability, torch.get_num_threads(), _triton_interpreted(), memory)


@functools.lru_cache(maxsize=None)
def _triton_interpreted():
    """TRITON_INTERPRET=1, which Triton reads as it decorates the kernels, once per process: asked once (a read of the
    environment takes more Python than the rest of a call's platform)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _cuda_memory(device_index):
    """The total memory in bytes of a CUDA device, fixed for the process: asked once."""
    return torch.cuda.get_device_properties(device_index).total_memory


class Backend:
    """A backend's entry point and what it can run: ``run(q, k, v, *, p, attn_mask, is_causal, document_ids, eps,
    formulation)`` returns the (B, H, Nq, dv) output; ``formulations`` are the names it implements, as its module
    declares them (``FORMULATIONS``), or a function that returns them for a module imported on first use;
    ``limits``, when given, states the input limits of its own. A backend with ``windows`` takes a causal sliding
    window as a size (``run(..., sliding_window=w)``, its limits too); the others get it as part of ``attn_mask``."""

    def __init__(self, name, run, formulations, differentiates_p=False, limits=None, windows=False):
        self.name, self.run, self._formulations = name, run, formulations
        self.differentiates_p, self.limits, self.windows = differentiates_p, limits, windows

    @property
    def formulations(self):
        return self._formulations() if callable(self._formulations) else self._formulations

    def unsupported_reason(self, query, key, value, *, p, p_trains, attn_mask, document_ids, formulation, platform,
                           is_causal=False, sliding_window=None):  # fmt: skip
        """Why this backend cannot run the input on this ``Platform``, or None (``attn_mask`` and ``sliding_window`` as
        ``inputs_for`` gives them)."""
        if p_trains and not self.differentiates_p:
            return f"backend {self.name!r} computes no gradient for p, which requires grad; use 'eager'"
        if formulation not in self.formulations:
            return f"backend {self.name!r} does not implement formulation {formulation!r}; use 'eager'"
        if self.limits is not None:
            window = dict(is_causal=is_causal, sliding_window=sliding_window) if self.windows else {}
            return self.limits(query, key, value, p=p, attn_mask=attn_mask, document_ids=document_ids,
                               formulation=formulation, platform=platform, **window)  # fmt: skip
        return None

    def inputs_for(self, attn_mask, sliding_window, num_queries, num_keys, device):
        """(attn_mask, sliding_window) as this backend takes them: the window as a size, or within the mask."""
        if sliding_window is None or self.windows:
            return attn_mask, sliding_window
        return with_window(attn_mask, sliding_window, num_queries, num_keys, device), None


def with_window(attn_mask, sliding_window, num_queries, num_keys, device):
    """``attn_mask`` (or None) and a causal sliding window's (Nq, Nk) band, as one boolean mask."""
    band = sliding_window_positions(num_queries, num_keys, sliding_window, device)
    return band if attn_mask is None else attn_mask & band


def _eager(query, key, value, **kwargs):
    return plap_attention_eager(query, key, value, **kwargs)[0]


# The Triton module imports triton (seconds) and, under TRITON_INTERPRET=1, the interpreter: loaded on first use, once
# (an import statement costs ~1.4 us per call even when the module is loaded).
@eager_cache
def _triton_backend():
    """(run, formulations, limits) of the Triton module."""
    from .plap_attention_triton import FORMULATIONS, plap_attention_triton, triton_unsupported_reason

    return plap_attention_triton, FORMULATIONS, triton_unsupported_reason


def _triton(query, key, value, **kwargs):
    return _triton_backend()[0](query, key, value, **kwargs)


def _triton_formulations():
    return _triton_backend()[1]


def _triton_limits(query, key, value, *, platform, **kwargs):
    if platform.device_type == "cpu" and not platform.triton_interpreted:
        return "the Triton kernels need CUDA tensors (CPU tensors run only under TRITON_INTERPRET=1)"
    return _triton_backend()[2](query, key, value, **kwargs, device_type=platform.device_type,
                                capability=platform.capability)  # fmt: skip


def _decode_limits(query, key, value, *, platform, **kwargs):
    return decode_unsupported_reason(query, key, value, **kwargs)


REGISTRY = {
    "eager": Backend("eager", _eager, FORMULATIONS, differentiates_p=True),
    "decode": Backend("decode", plap_attention_decode, DECODE_FORMULATIONS, limits=_decode_limits),
    "tiled": Backend("tiled", plap_attention_tiled, TILED_FORMULATIONS),
    "triton": Backend("triton", _triton, _triton_formulations, limits=_triton_limits, windows=True),
}
BACKENDS = ("auto", *REGISTRY)


# Dynamo before PyTorch 2.13 folds torch.compiler.is_exporting() to True in anything torch.compile traces, which made
# every compiled model run the eager reference. Called here, the flag is read in plain Python while tracing: True
# under torch.export alone (which sets it around its trace).
@torch.compiler.assume_constant_result
def _exporting():
    return torch.compiler.is_exporting()


def preference(query, key, platform):
    """Backends "auto" tries on this ``Platform``, fastest first (measured: `python benchmarks/bench_attention.py`).

    A few queries (decoding with a KV cache): the decode path. CUDA: the fused kernels, then eager where its
    weights take a small share of the GPU's memory, else tiled (O(N) memory). CPU: eager for small inputs, tiled
    above. While ``torch.export`` traces, the eager reference: plain tensor operations with no size-dependent Python
    loop.
    """
    if _exporting():
        return ("eager",)
    if query.shape[-2] <= DECODE_MAX_QUERIES:
        return ("decode", "eager")
    scores = query.shape[:-1].numel() * key.shape[-2]
    if platform.device_type == "cuda":
        eager_peak = scores * EAGER_PEAK_BYTES_PER_SCORE
        if platform.memory is None or eager_peak <= platform.memory * EAGER_MAX_MEMORY_SHARE_CUDA:
            return ("triton", "eager", "tiled")
        return ("triton", "tiled", "eager")
    if platform.device_type == "cpu" and scores <= EAGER_MAX_SCORES_PER_THREAD_CPU * platform.threads:
        return ("eager", "tiled")
    return ("tiled", "eager")


# Runs while torch.compile traces too (once per compiled graph), where a logging call would break the graph.
@torch.compiler.assume_constant_result
def _log_fallback(message):
    logger.warning_once(message)
    return True


# Eager calls' choices by signature (``choose_backend``), at most MAX_CHOICES of them.
_CHOICES = {}
MAX_CHOICES = 1024


def choose_backend(backend, query, key, value, *, p, p_trains=False, attn_mask=None, is_causal=False,
                   sliding_window=None, document_ids=None, formulation="paper", platform=None):  # fmt: skip
    """The backend that runs these heads: ``backend`` itself when it can (else a ValueError saying why), or for
    "auto" the first of ``preference`` with no objection. ``platform`` defaults to the inputs' device's.

    The choice reads the inputs' shapes, dtypes and devices, those of the mask and the document ids, and the other
    arguments, never a tensor's values: eager calls keep it by those facts and the ``Platform`` (a model's layers ask
    the same question at every step). A p that trains (a tensor) and torch.compile's trace choose afresh.
    """
    if platform is None:
        platform = device_platform(query.device.type, query.device.index)
    if p_trains or type(p) is not tuple or torch.compiler.is_compiling():
        return _choose(backend, query, key, value, p, p_trains, attn_mask, is_causal, sliding_window, document_ids,
                       formulation, platform)  # fmt: skip
    signature = (backend, platform, p, formulation, is_causal, sliding_window, query.shape, key.shape, value.shape,
                 query.dtype, key.dtype, value.dtype, query.device, key.device, value.device, _facts(attn_mask),
                 _facts(document_ids))  # fmt: skip
    chosen = _CHOICES.get(signature)
    if chosen is None:
        chosen = _choose(backend, query, key, value, p, p_trains, attn_mask, is_causal, sliding_window, document_ids,
                         formulation, platform)  # fmt: skip
        if len(_CHOICES) >= MAX_CHOICES:
            _CHOICES.clear()
        _CHOICES[signature] = chosen
    return chosen


def _choose(backend, query, key, value, p, p_trains, attn_mask, is_causal, sliding_window, document_ids, formulation,
            platform):  # fmt: skip
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    candidates = preference(query, key, platform) if backend == "auto" else (backend,)
    reasons = []
    for name in candidates:
        mask, window = REGISTRY[name].inputs_for(attn_mask, sliding_window, query.shape[-2], key.shape[-2],
                                                 query.device)  # fmt: skip
        reason = REGISTRY[name].unsupported_reason(
            query, key, value, p=p, p_trains=p_trains, attn_mask=mask, is_causal=is_causal, sliding_window=window,
            document_ids=document_ids, formulation=formulation, platform=platform,
        )  # fmt: skip
        if reason is None:
            break
        reasons.append(reason)
    else:
        if backend != "auto":
            raise ValueError(f"backend {backend!r} cannot run this input: {reasons[0]}")
        name = "eager"
    if reasons and candidates[0] == "triton":
        _log_fallback(f"p-LaT attention: plap_backend='auto' runs the {name!r} backend on CUDA instead of the fused "
                      f"Triton kernels{_memory_note(name, query, key)}, because {reasons[0]}")  # fmt: skip
    return REGISTRY[name]


# What the eager reference keeps for its backward per (query, key) pair: four float32 and two boolean (B, H, Nq, Nk)
# tensors (tests/attention/test_dispatch.py counts them).
EAGER_SAVED_BYTES_PER_SCORE = 18


def _memory_note(name, query, key):
    """What the backend chosen instead of the kernels keeps for the backward, for the fallback's message."""
    if name == "eager":
        mib = query.shape[:-1].numel() * key.shape[-2] * EAGER_SAVED_BYTES_PER_SCORE / 2**20
        return f" (which keeps about {mib:,.0f} MiB of (B, H, Nq, Nk) weights for the backward)"
    if name == "tiled":
        return " (which keeps O(N) memory for the backward, row statistics only)"
    return ""


def _facts(tensor):
    """(shape, dtype, device) of an optional tensor, or None: what the checks and the choice of backend read of a mask
    or of document ids."""
    return None if tensor is None else (tensor.shape, tensor.dtype, tensor.device)


@eager_cache
def _checked_call(shapes, num_p, p_values, p_trains, mask, documents, eps, formulation, sliding_window, is_causal):
    """What a call's checks settle, from its facts (a ValueError where one fails), kept per facts in eager calls: the
    causal sliding window's size or None (``_checked_window``), and the runs of heads by p (``head_groups``).
    ``shapes`` are those of q, k and v, ``mask`` and ``documents`` the ``_facts`` of the mask and the document ids;
    ``p_values``, ``p_trains``: ``_static_p``'s values (None where unknown on the host) and whether p trains, ``num_p``
    how many p there are."""
    _check_inputs(*shapes, num_p, mask, documents, eps, formulation)
    if p_values is not None:
        _checked_p(p_values)
    num_heads, num_keys = shapes[0][1], shapes[1][-2]
    groups = head_groups(None if p_trains else p_values, num_heads)
    return _checked_window(sliding_window, is_causal, num_keys), groups


def _check_inputs(query_shape, key_shape, value_shape, num_p, mask, documents, eps, formulation):
    if len(query_shape) != 4 or len(key_shape) != 4 or len(value_shape) != 4:
        raise ValueError(
            f"query, key and value must be 4-D (B, H, N, d); got {tuple(query_shape)}, "
            f"{tuple(key_shape)}, {tuple(value_shape)}"
        )
    if query_shape[:2] != key_shape[:2] or key_shape[:3] != value_shape[:3]:
        raise ValueError(
            f"query {tuple(query_shape)}, key {tuple(key_shape)} and value {tuple(value_shape)} must share "
            "(B, H), and key and value their length"
        )
    if query_shape[-1] != key_shape[-1]:
        raise ValueError(f"query and key head sizes differ: {query_shape[-1]} vs {key_shape[-1]}")
    batch, num_heads, num_queries = query_shape[:3]
    num_keys = key_shape[-2]
    if num_queries > num_keys:
        raise ValueError(
            f"p-Laplacian attention needs each query's own value: {num_queries} queries cannot be more "
            f"than {num_keys} keys"
        )
    if num_p != num_heads:
        raise ValueError(f"p must have one value per head ({num_heads}); got {num_p}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {tuple(FORMULATIONS)}; got {formulation!r}")
    if mask is not None:
        mask_shape, mask_dtype, _ = mask
        if mask_dtype != torch.bool:
            raise ValueError(f"attn_mask must be boolean (True = may attend); got {mask_dtype}")
        target = (batch, num_heads, num_queries, num_keys)
        try:
            torch.broadcast_shapes(mask_shape, target)
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(mask_shape)} does not broadcast to (B, H, Nq, Nk) = {target}"
            ) from None
    if documents is not None:
        document_shape, document_dtype, _ = documents
        if document_shape != (batch, num_keys) or num_queries != num_keys:
            raise ValueError(
                f"document_ids must be (B, N) = {(batch, num_keys)} with as many queries as keys (packed "
                f"sequences cannot use a KV cache); got {tuple(document_shape)} for {num_queries} queries"
            )
        if document_dtype.is_floating_point or document_dtype == torch.bool:
            raise ValueError(f"document_ids must be integers; got {document_dtype}")


def _window_size(sliding_window):
    """``sliding_window`` where it is an integer >= 1 or None, else a ValueError."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):  # fmt: skip
        raise ValueError(f"sliding_window must be an integer >= 1 or None; got {sliding_window!r}")
    return sliding_window


def _checked_window(sliding_window, is_causal, num_keys):
    """The window's size, or None where it leaves every causal pair (at least as long as the keys)."""
    if _window_size(sliding_window) is None:
        return None
    if not is_causal:
        raise ValueError("sliding_window needs is_causal=True: the window is (x - sliding_window, x] of each query x")
    return sliding_window if sliding_window < num_keys else None


def _static_p(p, num_heads):
    """(values, tensor): p per head as a tuple of floats, and p itself when it is a tensor that requires grad.

    A tensor is read on the host (a GPU synchronises): models pass tuples, known when they are built.
    """
    if isinstance(p, torch.Tensor):
        trains = p.requires_grad and torch.is_grad_enabled()
        if trains and (p.device.type != "cpu" or torch.compiler.is_compiling()):
            return None, p
        values = p.tolist()
        values = [values] * num_heads if p.dim() == 0 else values
        return tuple(map(float, values)), p if trains else None
    if isinstance(p, (int, float)):
        return (float(p),) * num_heads, None
    return tuple(map(float, p)), None


def _checked_p(p_values):
    """``p_values`` when every p is finite and >= 1, else a ValueError."""
    if not all(math.isfinite(v) and v >= 1 for v in p_values):
        raise ValueError(f"p must be finite and >= 1; got {list(p_values)}")
    return p_values


def head_groups(p_values, num_heads):
    """Runs of consecutive heads as (first, end, softmax), softmax True for a run of p = 2 heads.

    One run of every head when p's values are not known on the host (a p that trains on a GPU).
    """
    if p_values is None:
        return ((0, num_heads, False),)
    softmax = [value == 2 for value in p_values]
    return tuple((first, end, softmax[first]) for first, end in head_runs(softmax, one_value))


def _heads(tensor, first, end, num_heads):
    """Heads [first, end) of a (B|1, H|1, ...) tensor (a mask broadcast over heads stays whole)."""
    if tensor is None or (first, end) == (0, num_heads):
        return tensor
    four_d = tensor.view((1,) * (4 - tensor.dim()) + tuple(tensor.shape))  # (B|1, H|1, Nq|1, Nk|1)
    return four_d if four_d.shape[1] == 1 else four_d[:, first:end]


def softmax_attention(query, key, value, *, attn_mask=None, is_causal=False, document_ids=None):
    """Softmax attention (p = 2) through ``scaled_dot_product_attention``, with this module's conventions.

    Causal masking bottom-right aligned (SDPA's own is top-left when Nq < Nk); rows with no allowed key
    output zeros with zero gradients (some SDPA kernels give NaN there); the output in ``query``'s dtype.
    """
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    sdpa_causal = is_causal and attn_mask is None and document_ids is None and num_queries == num_keys
    allowed = None
    if not sdpa_causal:
        allowed = allowed_positions(
            attn_mask, is_causal and num_queries > 1, num_queries, num_keys, query.device, document_ids
        )
    with torch.autocast(query.device.type, enabled=False):
        key, value = key.to(query.dtype), value.to(query.dtype)
        if allowed is None:
            # A literal: under torch.compile and torch.export the lengths are symbols, and SDPA takes a plain bool.
            return F.scaled_dot_product_attention(query, key, value, is_causal=True if sdpa_causal else False)
        has_key = allowed.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed | ~has_key)
        return torch.where(has_key, out, 0)


def _one_dtype(query, key, value):
    """q, k and v in one dtype, as the fused kernels take them: under autocast its dtype, as autocast gives
    ``scaled_dot_product_attention`` (float64 stays float64); otherwise the widest of the three (an exact cast).
    P and the accumulations stay float32 or wider in every backend either way."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    device_type = query.device.type
    if torch.float64 not in dtypes and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif len(dtypes) == 1:
        return query, key, value
    else:
        dtype = functools.reduce(torch.promote_types, dtypes)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def plap_attention(
    query, key, value, p, *, attn_mask=None, is_causal=False, sliding_window=None, document_ids=None, eps=1e-6,
    formulation="paper", backend="auto",
):  # fmt: skip
    """p-Laplacian attention of (B, H, N, d) inputs with one exponent per head.

    Args:
        query: (B, H, Nq, d). key: (B, H, Nk, d). value: (B, H, Nk, dv), Nq <= Nk; the queries are the
            last Nq tokens (their own values are the last Nq values), as with a KV cache.
        p: one exponent per head, p >= 1: a sequence of floats (static: what models pass), a float for all
            heads, or an (H,) tensor (read on the host, unless it requires grad: then the eager backend
            differentiates it).
        attn_mask: optional boolean mask broadcastable to (B, H, Nq, Nk), True = may attend
            (the ``scaled_dot_product_attention`` convention).
        is_causal: causal mask, bottom-right aligned when Nq < Nk.
        sliding_window: with ``is_causal``, the query at key position x attends to the keys in (x - sliding_window,
            x] only, as transformers defines the window (the fused kernels visit only those keys' tiles).
        document_ids: optional (B, N) integers of packed rows (Nq == Nk): a token attends only within its
            document, so that each document gets what it gets alone.
        eps: added to the squared distances before the power.
        formulation: a key of ``FORMULATIONS`` ("paper": eq. 12, "euler": exact Euler step of eq. 7, ...).
        backend: "auto" or one of ``REGISTRY`` (see the module docstring).

    Returns:
        (B, H, Nq, dv) tensor in the one dtype that q, k and v are computed in: under autocast its dtype (as for
        ``scaled_dot_product_attention``), else the widest of theirs. Rows with every key masked are zero.
    """
    num_heads = query.shape[1] if query.dim() == 4 else 0
    p_values, p_tensor = _static_p(p, num_heads)
    num_p = len(p_values) if p_values is not None else p_tensor.numel()
    sliding_window, groups = _checked_call(
        (query.shape, key.shape, value.shape), num_p, p_values, p_tensor is not None, _facts(attn_mask),
        _facts(document_ids), eps, formulation, _window_size(sliding_window), is_causal,
    )  # fmt: skip
    query, key, value = _one_dtype(query, key, value)
    outputs, lengths = [], (query.shape[-2], key.shape[-2])
    for first, end, softmax in groups:
        q, k, v = (_heads(query, first, end, num_heads), _heads(key, first, end, num_heads),
                   _heads(value, first, end, num_heads))
        mask = _heads(attn_mask, first, end, num_heads)
        if softmax:
            mask = mask if sliding_window is None else with_window(mask, sliding_window, *lengths, query.device)
            outputs.append(softmax_attention(q, k, v, attn_mask=mask, is_causal=is_causal, document_ids=document_ids))
            continue
        group_p = p_tensor if p_tensor is not None else p_values[first:end]
        chosen = choose_backend(
            backend, q, k, v, p=group_p, p_trains=p_tensor is not None, attn_mask=mask, is_causal=is_causal,
            sliding_window=sliding_window, document_ids=document_ids, formulation=formulation,
        )  # fmt: skip
        mask, window = chosen.inputs_for(mask, sliding_window, *lengths, query.device)
        window = {} if window is None else dict(sliding_window=window)
        outputs.append(
            chosen.run(q, k, v, p=group_p, attn_mask=mask, is_causal=is_causal, document_ids=document_ids, eps=eps,
                       formulation=formulation, **window)
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, 1)  # (B, H, Nq, dv)


def repeat_kv(hidden_states, repeats):
    """(B, H_kv, T, d) -> (B, H_kv * repeats, T, d): key/value head j serves query heads j * repeats to
    (j + 1) * repeats - 1, as in transformers' repeat_kv. One repeat_interleave: ~2 us less per tensor than an expand
    and a reshape, a decoding step's cost at small sizes."""
    return hidden_states if repeats == 1 else hidden_states.repeat_interleave(repeats, dim=1)


def layer_attention(
    query, key, value, *, p, attn_mask=None, is_causal=False, sliding_window=None, document_ids=None, eps=1e-6,
    formulation="paper", backend="auto", dropout=0.0, output_attentions=False,
):  # fmt: skip
    """What an attention layer computes (p-LaT's own and, through ``attn_implementation="plap"``, transformers'):
    (output (B, H, Nq, dv), effective weights (B, H, Nq, Nk) or None).

    ``key`` and ``value`` have H_kv heads, H_kv dividing the H of ``query`` (grouped-query attention: a query head's
    distances are those of its key/value head, its p its own). ``dropout`` (the probability, 0 outside training) and
    ``output_attentions`` need the (B, H, Nq, Nk) weights, which only the eager reference materialises; otherwise
    ``plap_attention`` chooses the backend. Other arguments as ``plap_attention``.
    """
    repeats = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, repeats), repeat_kv(value, repeats)  # (B, H, Nk, d)
    options = dict(p=p, attn_mask=attn_mask, is_causal=is_causal, document_ids=document_ids, eps=eps,
                   formulation=formulation)  # fmt: skip
    if dropout > 0 or output_attentions:
        window = _checked_window(sliding_window, is_causal, key.shape[-2])
        if window is not None:
            options["attn_mask"] = with_window(attn_mask, window, query.shape[-2], key.shape[-2], query.device)
        return plap_attention_eager(query, key, value, **options, dropout=dropout, output_attentions=output_attentions)
    return plap_attention(query, key, value, **options, sliding_window=sliding_window, backend=backend), None
