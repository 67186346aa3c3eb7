"""What the dispatcher sees and chooses as models run it: one dtype under autocast, the same choice while torch.compile
traces as in eager mode, and no silent fall back from the fused kernels on CUDA.

A GPU's choices are proved on the CPU with a simulated CUDA ``Platform`` (the facts of the machine the dispatcher reads
once, outside the trace); there the Triton kernels run under the Triton interpreter (tests/conftest.py).
"""

import warnings

import pytest
import torch
from device import DEVICE, ON_CUDA
from spies import dispatch, record_chosen_backends
from tiny import TEXT_SHAPES, classifier, lm
from transformers.testing_utils import CaptureLogger

from modeling_plat import plap_attention_triton as triton_module
from modeling_plat import triton_configs
from modeling_plat.eager_cache import eager_cache
from modeling_plat.plap_dispatch import Platform

# An H100 as the dispatcher sees it (compute capability 9.0).
HOPPER = Platform("cuda", (9, 0), threads=torch.get_num_threads(), triton_interpreted=False, memory=80 * 2**30)
P_MIX = [1.5, 1.5, 2.5, 2.0]  # both powers and a softmax head
needs_triton = pytest.mark.skipif(triton_module.triton is None, reason="triton is not installed")


def tiny_model(shape):
    if shape == "vision":
        return classifier(plap_p=[1.5, 2.5, 2.0]).to(DEVICE)
    return lm(**TEXT_SHAPES[shape], plap_p=P_MIX, use_cache=False).to(DEVICE)


def model_inputs(shape):
    if shape == "vision":
        return dict(pixel_values=torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE),
                    labels=torch.tensor([0, 3], device=DEVICE))  # fmt: skip
    ids = torch.randint(2, 61, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return dict(input_ids=ids, labels=ids)


@pytest.mark.parametrize("shape", [*TEXT_SHAPES, "vision"])
def test_one_dtype_reaches_the_attention_under_autocast(monkeypatch, shape):
    """Under bf16 autocast (Trainer's --bf16) q, k and v reach plap_attention in bf16 for every model shape (the
    Llama shape's rotary once made q and k float32 beside bf16 values), and on a GPU the fused kernels take them."""
    seen = []
    attend = dispatch.plap_attention

    def recording(query, key, value, p, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        on_gpu = dispatch.choose_backend("auto", query, key, value, p=p, attn_mask=kwargs["attn_mask"],
                                         document_ids=kwargs["document_ids"], platform=HOPPER)  # fmt: skip
        seen.append(on_gpu.name)
        return attend(query, key, value, p, **kwargs)

    monkeypatch.setattr(dispatch, "plap_attention", recording)
    model = tiny_model(shape).train()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = model(**model_inputs(shape)).loss
    loss.backward()
    assert seen and seen[0::2] == [(torch.bfloat16,) * 3] * (len(seen) // 2)
    assert set(seen[1::2]) == {"triton"}
    assert torch.isfinite(loss)


def test_mixed_dtypes_are_computed_in_one():
    """Outside autocast mixed inputs are cast to the widest (exactly); under it to autocast's dtype, as SDPA is."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen).to(DEVICE) for _ in range(3))
    p = (1.5, 2.5)
    expected = dispatch.plap_attention(q, k, v.bfloat16().float(), p, is_causal=True)
    mixed = dispatch.plap_attention(q, k, v.bfloat16(), p, is_causal=True)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, expected, rtol=0, atol=0)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert dispatch.plap_attention(q, k, v.bfloat16(), p, is_causal=True).dtype == torch.bfloat16


def test_fallback_from_the_fused_kernels_is_logged_once_per_reason():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 7, 16, generator=gen).to(DEVICE)
    general_mask = torch.rand(2, 3, 7, 7, generator=gen).to(DEVICE) > 0.3  # not a key-padding mask
    logger = dispatch.logger
    with CaptureLogger(logger) as captured:
        for _ in range(2):
            chosen = dispatch.choose_backend("auto", q, q, q, p=(1.5,) * 3, attn_mask=general_mask, platform=HOPPER)
    assert chosen.name == "eager"
    assert captured.out.count("runs the 'eager' backend on CUDA instead of the fused Triton kernels") == 1
    assert "key-padding" in captured.out and "about 0 MiB" in captured.out
    with CaptureLogger(logger) as captured:  # the kernels run it: nothing to say
        assert dispatch.choose_backend("auto", q, q, q, p=(1.5,) * 3, platform=HOPPER).name == "triton"
    assert captured.out == ""


def test_the_fallback_on_cuda_is_eager_while_its_weights_fit_a_share_of_the_gpu():
    """Where the kernels refuse an input, eager (measured faster on a GPU) runs while its (B, H, Nq, Nk) peak takes at
    most EAGER_MAX_MEMORY_SHARE_CUDA of the GPU's memory, and tiled (O(N) memory) above, each saying so."""
    budget = HOPPER.memory * dispatch.EAGER_MAX_MEMORY_SHARE_CUDA / dispatch.EAGER_PEAK_BYTES_PER_SCORE
    fits = int(budget**0.5) // 8  # B = H = 1, (8 * fits)^2 scores: within the share; twice as long: over it
    for length, expected in ((8 * fits, "eager"), (16 * fits, "tiled")):
        q = torch.empty(1, 1, length, 64, device="meta")
        mask = torch.empty(1, 1, length, length, dtype=torch.bool, device="meta")  # a general mask: no kernel takes it
        with CaptureLogger(dispatch.logger) as captured:
            chosen = dispatch.choose_backend("auto", q, q, q, p=(1.5,), attn_mask=mask, platform=HOPPER)
        assert chosen.name == expected
        assert f"runs the '{expected}' backend on CUDA instead" in captured.out
        assert ("MiB" if expected == "eager" else "O(N) memory") in captured.out


@needs_triton
@pytest.mark.skipif(ON_CUDA, reason="simulates a GPU of an unknown compute capability on the CPU")
def test_an_unknown_gpu_runs_the_conservative_tiles_and_says_so_once(monkeypatch):
    """A compute capability the tables do not know (11.9 here) runs the fused kernels with the conservative tiles, and
    says so once, in eager mode and while torch.compile traces (fullgraph: the log is no graph break)."""
    unknown = Platform("cuda", (11, 9), threads=torch.get_num_threads(), triton_interpreted=False)
    monkeypatch.setattr(dispatch, "device_platform", lambda device_type, device_index: unknown)
    names = record_chosen_backends(monkeypatch)
    q = torch.randn(2, 3, 20, 16, generator=torch.Generator().manual_seed(0))

    def attend(q):
        return dispatch.plap_attention(q, q, q, (1.5, 2.5, 1.5), is_causal=True)

    with CaptureLogger(triton_configs.logger) as captured:
        eager = attend(q)
        torch._dynamo.reset()
        compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q)
    assert set(names) == {"triton"} and len(names) >= 2
    torch.testing.assert_close(compiled, eager)
    assert captured.out.count("compute capability 11.9 is not one the fused Triton kernels are checked for") == 1
    assert "runs the tiles of compute capability 8.x" in captured.out


def exporting_as_dynamo_before_2_13():
    """torch.compiler.is_exporting as Dynamo of PyTorch < 2.13 traced it: True in code that torch.compile traces
    (is_dynamo_compiling() is folded to True there), the flag itself when called in plain Python."""
    exporting = torch.compiler.is_exporting
    return lambda: torch.compiler.is_dynamo_compiling() or exporting()


@needs_triton
@pytest.mark.parametrize("shape", TEXT_SHAPES)
def test_traced_choice_is_the_eager_choice_on_cuda(monkeypatch, shape):
    """With a GPU's platform, a training step compiled with fullgraph=True runs exactly the backends that eager mode
    runs, the fused kernels for the p != 2 heads, with no call that Dynamo cannot trace (it would fail fullgraph);
    also where Dynamo reads is_exporting() as True under torch.compile (PyTorch < 2.13: it once chose eager there)."""
    if not ON_CUDA:
        monkeypatch.setattr(dispatch, "device_platform", lambda device_type, device_index: HOPPER)
    monkeypatch.setattr(torch.compiler, "is_exporting", exporting_as_dynamo_before_2_13())
    names = record_chosen_backends(monkeypatch)
    model = tiny_model(shape).train()
    inputs = model_inputs(shape)

    def step(input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    eager_loss = step(**inputs)
    eager_names = list(names)
    names.clear()
    torch._dynamo.reset()
    compiled_loss = torch.compile(step, backend="aot_eager", fullgraph=True)(**inputs)
    assert names == eager_names and set(eager_names) == {"triton"}
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(**inputs)
    assert explained.graph_break_count == 0, [str(reason.reason)[:200] for reason in explained.break_reasons]


def test_the_eager_fallback_states_the_memory_it_keeps():
    """The bytes per (query, key) pair the eager reference keeps for its backward, which its fallback message
    states, are what autograd saves, counted tensor by tensor: the part that grows with Nq * Nk, from two lengths
    (the caller's own mask aside)."""

    def saved_bytes(length):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, length, 16, generator=gen, requires_grad=True) for _ in range(3))
        mask = torch.rand(2, 4, length, length, generator=gen) > 0.1
        saved = {}

        def pack(tensor):
            if tensor.data_ptr() != mask.data_ptr():
                saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            dispatch.plap_attention(q, k, v, (1.5, 2.5, 1.5, 3.0), attn_mask=mask, backend="eager")
        return sum(saved.values()) / (2 * 4)

    per_score = (saved_bytes(80) - 2 * saved_bytes(40)) / (80**2 - 2 * 40**2)
    assert per_score == pytest.approx(dispatch.EAGER_SAVED_BYTES_PER_SCORE, abs=0.01)
    big = torch.empty(4, 16, 4096, 64, device="meta")
    assert "about 18,432 MiB" in dispatch._memory_note("eager", big, big)


def test_eager_cache_keeps_results_between_eager_calls_and_computes_them_while_tracing():
    calls = []

    @eager_cache
    def heads_scale(num_heads, scale):
        calls.append((num_heads, scale))
        return num_heads * scale

    def attend(q):
        return q * heads_scale(q.shape[1], 2.0)

    q = torch.randn(2, 3, 4, device=DEVICE)
    assert [heads_scale(3, 2.0), heads_scale(3, 2.0), heads_scale(4, 2.0)] == [6.0, 6.0, 8.0]
    assert calls == [(3, 2.0), (4, 2.0)]
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q)
    assert calls == [(3, 2.0), (4, 2.0), (3, 2.0)]  # traced: the function itself, not the cache
    torch.testing.assert_close(compiled, q * 6.0)


@needs_triton
def test_compiled_attention_traces_no_cache_wrapper(monkeypatch):
    """What ``eager_cache`` keeps (the heads' groups, the launch configuration) is computed afresh while Dynamo traces:
    a cache wrapper in the trace would cost the user a warning of Dynamo's (and a guess at its result)."""
    if not ON_CUDA:
        monkeypatch.setattr(dispatch, "device_platform", lambda device_type, device_index: HOPPER)
    q = torch.randn(2, 4, 20, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def attend(q):
        return dispatch.plap_attention(q, q, q, tuple(P_MIX), is_causal=True, backend="triton")

    eager = attend(q)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q)
    assert not [str(warning.message)[:200] for warning in caught if "lru_cache" in str(warning.message)]
    torch.testing.assert_close(compiled, eager)


def test_a_kept_choice_is_the_one_each_fact_of_the_call_gives(monkeypatch):
    """Eager calls keep the choice of backend by what it reads (``choose_backend``): a repeated call decides nothing
    again, and a call that differs in any one of those facts gets the choice its own facts give, not a kept one."""
    decided = []
    decide = dispatch._choose
    monkeypatch.setattr(dispatch, "_choose", lambda *args: decided.append(args) or decide(*args))
    q = torch.zeros(2, 3, 16, 8, device=DEVICE)
    call = dict(backend="auto", query=q, key=q, value=q, p=(1.5, 2.5, 1.5), is_causal=True)
    big = torch.zeros(2, 3, 256, 8, device=DEVICE)  # above the CPU's eager limit with one thread
    variants = {
        "the same call": {},
        "another backend": dict(backend="tiled"),
        "another p": dict(p=(1.5, 1.5, 1.5)),
        "another formulation": dict(formulation="euler"),
        "not causal": dict(is_causal=False),
        "a sliding window": dict(sliding_window=4),
        "another dtype": dict(query=q.double(), key=q.double(), value=q.double()),
        "longer keys": dict(key=big[:, :, :20], value=big[:, :, :20]),
        "a key-padding mask": dict(attn_mask=torch.ones(2, 1, 1, 16, dtype=torch.bool, device=DEVICE)),
        "a general mask": dict(attn_mask=torch.ones(2, 3, 16, 16, dtype=torch.bool, device=DEVICE)),
        "document ids": dict(document_ids=torch.zeros(2, 16, dtype=torch.long, device=DEVICE)),
        "a GPU": dict(platform=HOPPER),
        "one thread": dict(query=big, key=big, value=big,
                           platform=dispatch.device_platform(DEVICE.type, None)._replace(threads=1)),
    }  # fmt: skip

    def choose(arguments):
        arguments = dict(arguments)
        backend, query, key, value = (arguments.pop(name) for name in ("backend", "query", "key", "value"))
        return dispatch.choose_backend(backend, query, key, value, **arguments)

    choose(call)
    for name, change in variants.items():
        decided.clear()
        arguments = {**call, **change}
        first, again = choose(arguments), choose(arguments)
        platform = arguments.get("platform") or dispatch.device_platform(DEVICE.type, DEVICE.index)
        fresh = decide(arguments["backend"], arguments["query"], arguments["key"], arguments["value"], arguments["p"],
                       False, arguments.get("attn_mask"), arguments["is_causal"], arguments.get("sliding_window"),
                       arguments.get("document_ids"), arguments.get("formulation", "paper"), platform)  # fmt: skip
        assert first is again is fresh, name
        assert len(decided) == (name != "the same call"), name  # once, the first time its facts came
    # Choices that read what they cannot keep are made afresh: a p that trains.
    decided.clear()
    trained = torch.tensor([1.5, 2.5, 1.5], requires_grad=True)
    for _ in range(2):
        assert dispatch.choose_backend("auto", q.cpu(), q.cpu(), q.cpu(), p=trained, p_trains=True).name == "eager"
    assert len(decided) == 2


def test_the_checks_of_a_call_raise_at_every_call():
    """What the checks settle is kept per call's facts; a call that fails them raises every time, and does not keep
    a later good call from running."""
    q = torch.zeros(1, 2, 8, 4, device=DEVICE)
    for _ in range(2):
        with pytest.raises(ValueError, match="p must have one value per head"):
            dispatch.plap_attention(q, q, q, (1.5,))
        with pytest.raises(ValueError, match="sliding_window must be an integer"):
            dispatch.plap_attention(q, q, q, (1.5, 2.5), is_causal=True, sliding_window=[4])
        with pytest.raises(ValueError, match="attn_mask must be boolean"):
            dispatch.plap_attention(q, q, q, (1.5, 2.5), attn_mask=torch.ones(1, 1, 1, 8, device=DEVICE))
    expected = dispatch.plap_attention(q, q, q, (1.5, 2.5), backend="eager")
    # auto may take the fused kernels (a GPU's float32 matmuls: tf32x3), hence float32's tolerance of the backends
    torch.testing.assert_close(dispatch.plap_attention(q, q, q, (1.5, 2.5)), expected, rtol=1e-4, atol=1e-5)
