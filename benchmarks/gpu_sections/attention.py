"""The attention, envelope and fallback sections: one bfloat16 plap_attention forward and forward + backward against
scaled_dot_product_attention, at the kernels' shapes, at what reached the kernels last, and where they cannot run."""

import contextlib
import functools
import statistics

import torch

from modeling_plat import paper_p_mix
from modeling_plat.plap_dispatch import plap_attention

from .measure import bf16_attention_inputs, error_fields, paired_ratio, peak_memory_mib, side_by_side

# name: (batch, heads, length, head size, causal)
ATTENTION_SHAPES = {
    "paper-lm": (16, 8, 256, 16, True),
    "deit-tiny": (64, 3, 197, 64, False),
    "1k": (8, 12, 1024, 64, True),
    "4k": (2, 16, 4096, 64, True),
    "4k-d128": (2, 16, 4096, 128, True),
    "16k": (1, 8, 16384, 64, True),
}
# The kernel-speed targets against SDPA's default backend: (shape, fwd or fwd_bwd, limit), and peak memory.
KERNEL_SPEED_TARGETS = [("4k", "fwd", 2.0), ("4k", "fwd_bwd", 2.5), ("4k-d128", "fwd_bwd", 3.0), ("16k", "fwd_bwd", 2.5)]
KERNEL_SPEED_SHAPES = tuple(dict.fromkeys(name for name, _, _ in KERNEL_SPEED_TARGETS))
PEAK_MEMORY_LIMIT = 1.2
# label: the SDPBackend scaled_dot_product_attention is restricted to (None: its own choice).
SDPA_VARIANTS = {"sdpa": None, "sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
# Multiply-adds of the matmuls per score and head-size unit: forward, forward + backward.
MATMUL_FLOOR = {"plat": (3, 11), "sdpa": (2, 7)}


def sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attention_timings(calls, inputs, grad_out, work, device, warmup, repeats):
    """Each of ``calls`` ({label: (call(), floor)}) timed side by side (``side_by_side``), forward without gradients
    and forward + backward: {label: milliseconds (medians), TFLOP/s against ``floor`` multiply-adds per unit of
    ``work``, the peak memory of a forward + backward and the backends chosen, or ``error_fields`` where it raised}, and
    {label: the first label's ``paired_ratio`` to this later one's, forward and forward + backward, with their ranges}.
    """

    def forward_backward(call):
        return lambda: torch.autograd.grad(call(), inputs, grad_out)

    with torch.no_grad():
        forward = side_by_side({label: call for label, (call, _) in calls.items()}, device, warmup, repeats)
    both = side_by_side({label: forward_backward(call) for label, (call, _) in calls.items()}, device, warmup, repeats)
    timings = {}
    for label, (call, floor) in calls.items():
        raised = [part[label] for part in (forward, both) if "error" in part[label]]
        if raised:
            timings[label] = raised[0]
            continue
        fwd, fwd_bwd = (statistics.median(part[label]["seconds"]) for part in (forward, both))
        timings[label] = dict(fwd_ms=fwd * 1e3, fwd_bwd_ms=fwd_bwd * 1e3, fwd_tflops=2 * floor[0] * work / fwd / 1e12,
                              fwd_bwd_tflops=2 * floor[1] * work / fwd_bwd / 1e12,
                              backends=dict(forward[label]["backends"] + both[label]["backends"]))  # fmt: skip
        try:
            timings[label]["fwd_bwd_peak_mib"] = peak_memory_mib(forward_backward(call), device)
        except Exception as error:
            timings[label] = error_fields(error)
    first, *others = calls
    ratios = {}
    for label in others:
        if "error" not in timings[first] and "error" not in timings[label]:
            ratios[label] = {}
            for part, results in (("fwd", forward), ("fwd_bwd", both)):
                ratio, spread = paired_ratio(results[first]["seconds"], results[label]["seconds"])
                ratios[label].update({part: ratio, f"{part}_range": spread})
    return timings, ratios


def timed_fields(timings, ratios):
    """A row's fields from ``attention_timings``: each label's timings, where p-LaT ("plat") raised the row's error,
    where a baseline raised ``unavailable`` (a backend this GPU or shape does not offer, or memory it lacks: no
    failure of ours), and ``ratio_to_<label>``."""
    fields = {}
    for label, timing in timings.items():
        if "error" not in timing:
            fields[label] = timing
        elif label == "plat":
            fields.update(timing)
        else:
            fields[label] = dict(unavailable=timing["error"][:300])
    fields.update({f"ratio_to_{label}": ratio for label, ratio in ratios.items()})
    return fields


def attention_row(name, shape, device, warmup, repeats):
    batch, heads, length, head_dim, causal = shape
    q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
    p = tuple(paper_p_mix(heads))
    work = batch * heads * length * length * (0.5 if causal else 1.0) * head_dim
    row = dict(name=name, batch=batch, heads=heads, length=length, head_dim=head_dim, causal=causal)
    calls = {"plat": (lambda: plap_attention(q, k, v, p, is_causal=causal), MATMUL_FLOOR["plat"])}
    for label, backend in SDPA_VARIANTS.items():
        calls[label] = functools.partial(sdpa, q, k, v, causal, backend), MATMUL_FLOOR["sdpa"]
    row.update(timed_fields(*attention_timings(calls, (q, k, v), grad_out, work, device, warmup, repeats)))
    return row


def attention_section(device, log, shapes=ATTENTION_SHAPES, warmup=3, repeats=10):
    rows = []
    for name, shape in shapes.items():
        rows.append(attention_row(name, shape, device, warmup, repeats))
        ratios = {label: round(rows[-1][f"ratio_to_{label}"]["fwd_bwd"], 2)
                  for label in SDPA_VARIANTS if f"ratio_to_{label}" in rows[-1]}  # fmt: skip
        log(f"attention {name}: plat fwd+bwd / {ratios} {rows[-1].get('error', '')}")
    return rows


# name: (batch, heads, length, head size, what the inputs add): the inputs that reached the fused kernels last
ENVELOPE_SHAPES = {
    "window-4096-16k": (1, 8, 16384, 64, dict(sliding_window=4096)),  # Mistral's window over 16k tokens
    "d256-4k": (2, 8, 4096, 256, {}),  # Gemma 2/3's head size
    "packed-4k": (1, 16, 4096, 64, dict(documents=(1000, 24, 1500, 800, 772))),  # padding-free training
    # Llama 4's chunked layers: plap_mask makes each chunk a document of the kernels
    "chunks-8192-16k": (1, 8, 16384, 64, dict(documents=(8192, 8192))),
}
ENVELOPE_LIMIT = 3.0  # forward + backward against SDPA given the same pattern


def flash_window(q, k, v, window):
    """FlashAttention-2's own sliding window (the flash_attn package), where installed."""
    from flash_attn import flash_attn_func

    # (B, N, H, d); keys in [x - (window - 1), x].
    out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, window_size=(window - 1, 0))
    return out.transpose(1, 2)


def envelope_row(name, shape, device, warmup, repeats):
    """p-LaT (auto) against SDPA given the same pattern as a boolean mask (its default backend chooses), and
    FlashAttention-2's window where installed; forward + backward, peak memory, the backends auto chose."""
    from modeling_plat.plap_attention_reference import allowed_positions, sliding_window_positions

    batch, heads, length, head_dim, extra = shape
    q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
    p = tuple(paper_p_mix(heads))
    kwargs, mask, baselines = dict(is_causal=True), None, {}
    if "sliding_window" in extra:
        kwargs["sliding_window"] = extra["sliding_window"]
        mask = sliding_window_positions(length, length, extra["sliding_window"], device)
        baselines["flash-window"] = functools.partial(flash_window, q, k, v, extra["sliding_window"])
    if "documents" in extra:
        ids = torch.repeat_interleave(torch.arange(len(extra["documents"]), device=device),
                                      torch.tensor(extra["documents"], device=device))[None].expand(batch, -1)
        kwargs["document_ids"] = ids
        mask = allowed_positions(None, True, length, length, device, ids)
    pairs = int(mask.expand(batch, 1, length, length).sum()) if mask is not None else batch * length * (length + 1) // 2
    work = pairs * heads * head_dim
    row = dict(name=name, batch=batch, heads=heads, length=length, head_dim=head_dim,
               pattern={key: value for key, value in extra.items()})  # fmt: skip

    def sdpa_pattern():
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    calls = {"plat": (lambda: plap_attention(q, k, v, p, **kwargs), MATMUL_FLOOR["plat"])}
    calls.update({label: (call, MATMUL_FLOOR["sdpa"]) for label, call in {"sdpa": sdpa_pattern, **baselines}.items()})
    row.update(timed_fields(*attention_timings(calls, (q, k, v), grad_out, work, device, warmup, repeats)))
    return row


def envelope_section(device, log, shapes=ENVELOPE_SHAPES, warmup=3, repeats=10):
    rows = []
    for name, shape in shapes.items():
        rows.append(envelope_row(name, shape, device, warmup, repeats))
        ratio = rows[-1].get("ratio_to_sdpa", {}).get("fwd_bwd")
        log(f"envelope {name}: plat fwd+bwd / sdpa {ratio} {rows[-1].get('plat', {}).get('backends')} "
            f"{rows[-1].get('error', '')}")
    return rows


def row_jobs(section, row, shapes, device):
    """A section's rows made by ``row(name, shape, device, warmup, repeats)`` (``attention_row``, ``envelope_row``),
    each run once untimed: precompilation's jobs (``precompile``)."""
    return [(f"{section} {name}", functools.partial(row, name, shape, device, 0, 1)) for name, shape in shapes.items()]


# Inputs the fused kernels refuse (a (B, H, N, N) mask, p that trains): eager against tiled on CUDA, bfloat16.
FALLBACK_SHAPES = {"512": (4, 8, 512, 64), "2k": (2, 8, 2048, 64), "8k": (1, 8, 8192, 64)}


def fallback_section(device, log, shapes=FALLBACK_SHAPES, warmup=2, repeats=5):
    """Forward + backward time and peak memory of the eager and tiled backends where the kernels cannot run: what
    ``auto`` should take on CUDA for them."""
    rows = []
    for name, (batch, heads, length, head_dim) in shapes.items():
        q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
        mask = torch.rand(batch, heads, length, length, device=device) > 0.1  # a full mask: no kernel takes it
        p = tuple(paper_p_mix(heads))
        row = dict(name=name, batch=batch, heads=heads, length=length, head_dim=head_dim)
        calls = {backend: (functools.partial(plap_attention, q, k, v, p, attn_mask=mask, backend=backend),
                           MATMUL_FLOOR["plat"]) for backend in ("eager", "tiled")}  # fmt: skip
        timings, _ = attention_timings(calls, (q, k, v), grad_out, 1, device, warmup, repeats)
        row.update(timed_fields(timings, {}))  # one that raised (out of memory, most likely) is unavailable
        times = {b: row[b]["fwd_bwd_ms"] for b in ("eager", "tiled") if "fwd_bwd_ms" in row[b]}
        row["faster"] = min(times, key=times.get) if times else None
        log(f"fallback {name}: fwd+bwd ms {times}, peak MiB "
            f"{ {b: row[b].get('fwd_bwd_peak_mib') for b in ('eager', 'tiled')} }")
        rows.append(row)
        torch.cuda.empty_cache()
    return rows
