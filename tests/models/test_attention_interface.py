"""attn_implementation="plap": transformers' own models with p-LaT attention.

Every family is a tiny random config of its transformers class: at p = 2 its logits (left padding included) and
cached greedy generations are those of the same model with transformers' eager attention, and the paper's mix (the
default where the config sets no p) changes them. At p != 2 the reference is PlatForCausalLM with the same weights.
"""

import copy

import pytest
import torch
from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask
from transformers import (
    DataCollatorWithFlattening,
    AutoModelForCausalLM,
    BartConfig,
    BartModel,
    BertGenerationConfig,
    BertGenerationDecoder,
    DeiTConfig,
    DeiTForImageClassification,
    DeiTForImageClassificationWithTeacher,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

import modeling_plat
from device import DEVICE
from modeling_plat import PlatForImageClassification
from modeling_plat import attention_interface
from modeling_plat.attention_interface import plap_mask
from modeling_plat.convert import convert_to_plat
from tiny import TINY_DECODER as DECODER

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
LENGTH = 10  # longer than every sliding window and chunk below, and than llama3 rope's original context
# The checkpoints users pick, as tiny configs: Llama 3.x rope, Qwen2.5's q/k/v biases, Qwen3's q/k norms and wider
# heads, Mistral with a window shorter than the input, Phi-3's fused projections and partial rotary, Gemma 2 and 3
# (query_pre_attn_scalar != head_dim, alternating sliding/full layers, Gemma 2's final logit softcap), SmolLM3's
# tied embeddings and layers without rotary positions, Llama 4's chunked attention (a mixture of experts).
FAMILIES = {
    "llama3": (LlamaForCausalLM, LlamaConfig(**DECODER, rope_parameters=LLAMA3_ROPE)),
    "qwen2.5": (Qwen2ForCausalLM, Qwen2Config(**DECODER)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**DECODER, head_dim=16)),
    "mistral-window": (MistralForCausalLM, MistralConfig(**DECODER, sliding_window=4)),
    "phi3": (Phi3ForCausalLM, Phi3Config(**DECODER, partial_rotary_factor=0.5)),
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(**DECODER, head_dim=8, query_pre_attn_scalar=12, sliding_window=4,
                                               attn_logit_softcapping=None, final_logit_softcapping=30.0)),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**DECODER, head_dim=8, query_pre_attn_scalar=12, sliding_window=4,
                                                   layer_types=["sliding_attention", "full_attention"])),
    "smollm3-tied": (SmolLM3ForCausalLM, SmolLM3Config(**DECODER, tie_word_embeddings=True)),
    "llama4-chunked": (Llama4ForCausalLM, Llama4TextConfig(**DECODER, head_dim=8, attention_chunk_size=4,
                                                           intermediate_size_mlp=48, num_local_experts=2)),
}


def family(name, attn_implementation, **fields):
    """The family's model with seeded random weights (biases too) and ``fields`` set on its config."""
    model_class, config = FAMILIES[name]
    config = copy.deepcopy(config)
    for field, value in fields.items():
        setattr(config, field, value)
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(std=0.1)
    return model.to(DEVICE).eval()


def batch():
    """Two rows of LENGTH tokens, the first left-padded by 3."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, DECODER["vocab_size"], (2, LENGTH), generator=generator).to(DEVICE)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    return input_ids, attention_mask


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_p2_matches_eager_attention(name):
    eager, plap = family(name, "eager"), family(name, "plap", plap_p=2.0)
    assert plap.config._attn_implementation == "plap"
    input_ids, attention_mask = batch()
    real = attention_mask.bool()
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(plap(input_ids, attention_mask=attention_mask).logits[real], expected[real],
                                   atol=2e-6, rtol=1e-5)
        # The padded row gives the logits of its tokens alone.
        torch.testing.assert_close(plap(input_ids[:1, 3:]).logits[0], expected[0, 3:], atol=2e-6, rtol=1e-5)
    generate = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(plap.generate(input_ids, **generate), eager.generate(input_ids, **generate))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_paper_mix_changes_outputs(name):
    softmax, mix = family(name, "plap", plap_p=2.0), family(name, "plap")
    assert not hasattr(mix.config, "plap_p")  # the paper's mix by default
    input_ids, _ = batch()
    with torch.no_grad():
        change = (mix(input_ids).logits - softmax(input_ids).logits).abs().max()
    assert change > 1e-2


def test_sliding_window_is_honoured():
    input_ids, _ = batch()
    with torch.no_grad():
        windowed = family("mistral-window", "plap", plap_p=2.0)(input_ids).logits
        full = family("mistral-window", "plap", plap_p=2.0, sliding_window=None)(input_ids).logits
        # Tokens within the window of the start see the same keys either way; later ones do not.
        torch.testing.assert_close(windowed[:, :4], full[:, :4])
        assert (windowed[:, 4:] - full[:, 4:]).abs().max() > 1e-3
        # At p != 2 every backend keeps the window: the reference (eager) against the choice of "auto", the tiled
        # backend (the window folded into its mask) and the fused kernels (the window as a size).
        reference = family("mistral-window", "plap", plap_backend="eager")(input_ids).logits
        for backend in ("auto", "tiled", "triton"):
            torch.testing.assert_close(family("mistral-window", "plap", plap_backend=backend)(input_ids).logits,
                                       reference, atol=1e-5, rtol=1e-4)


def test_chunked_attention_is_honoured(monkeypatch):
    """Llama 4's chunks, which start after each row's left padding, reach every backend as the chunk of each key
    (the fused kernels visit each chunk's span alone) and give what transformers' (B, 1, N, N) chunked mask gives."""
    input_ids, attention_mask = batch()
    real = attention_mask.bool()
    with torch.no_grad():
        chunked = {backend: family("llama4-chunked", "plap", plap_backend=backend)(input_ids,
                                                                                  attention_mask=attention_mask)
                   for backend in ("auto", "eager", "tiled", "triton")}  # fmt: skip
        monkeypatch.setattr(attention_interface, "_is_chunked", lambda mask_function: False)
        reference = family("llama4-chunked", "plap", plap_backend="eager")(input_ids, attention_mask=attention_mask)
        one_chunk = family("llama4-chunked", "plap", attention_chunk_size=LENGTH)(input_ids,
                                                                                  attention_mask=attention_mask)
    for backend, output in chunked.items():
        torch.testing.assert_close(output.logits[real], reference.logits[real], atol=1e-5, rtol=1e-4)
    assert (chunked["auto"].logits[real] - one_chunk.logits[real]).abs().max() > 1e-3


def _chunked_masks(left_padding, q_length, kv_length, kv_offset):
    """plap_mask's and sdpa_mask's masks of Llama 4's chunks of 4, two rows, the first left-padded."""
    padding = torch.ones(2, kv_offset + kv_length, dtype=torch.bool)
    padding[0, :left_padding] = False
    pattern = chunked_causal_mask_function(4, (~padding).sum(-1))
    sizes = dict(q_offset=kv_offset + kv_length - q_length, kv_offset=kv_offset, mask_function=pattern,
                 attention_mask=padding, local_size=4)
    expected = sdpa_mask(2, q_length, kv_length, **sizes, allow_is_causal_skip=False)
    return plap_mask(2, q_length, kv_length, **sizes), expected


@pytest.mark.parametrize("left_padding", [0, 3, 4, 9])
def test_chunked_mask_holds_each_keys_chunk(left_padding):
    """As many queries as keys: (B, 1, 1, N) chunks, -1 for padding, that mean transformers' chunked mask."""
    chunks, expected = _chunked_masks(left_padding, 12, 12, 0)
    assert chunks.shape == (2, 1, 1, 12) and chunks.dtype not in (torch.bool, torch.float32)
    keys = chunks[:, 0, 0]
    same = (keys[:, :, None] == keys[:, None, :]) & (keys[:, None, :] >= 0)
    assert torch.equal(same & torch.ones(12, 12, dtype=torch.bool).tril(), expected[:, 0])


@pytest.mark.parametrize("kv_offset", [0, 5, 6])
def test_chunked_mask_when_decoding_is_the_querys_chunk(kv_offset):
    """One query after a chunked layer's sliding cache: the real keys of its chunk, as a key mask."""
    mask, expected = _chunked_masks(3, 1, 4, kv_offset)
    assert torch.equal(mask, expected)


def test_chunked_mask_of_one_chunk_is_plain_causal():
    assert _chunked_masks(0, 4, 4, 0)[0] is None
    assert torch.equal(_chunked_masks(2, 4, 4, 0)[0], torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]).bool()[:, None, None])


P_PER_LAYER = [[1.5, 2.0, 2.5, 3.0], [2.0, 1.25, 1.5, 2.5]]


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("plap_p", [None, [1.5, 2.0, 2.5, 1.5], P_PER_LAYER], ids=["mix", "per-head", "per-layer"])
def test_matches_platforcausallm(plap_p, formulation):
    """Llama with attn_implementation="plap" computes what PlatForCausalLM with its weights computes, at any p."""
    fields = {"plap_formulation": formulation} | ({} if plap_p is None else {"plap_p": plap_p})
    llama = family("llama3", "plap", rope_parameters={"rope_type": "default", "rope_theta": 5e5}, **fields)
    plat = convert_to_plat(llama, plap_p=plap_p, plap_formulation=formulation)
    input_ids, attention_mask = batch()
    real = attention_mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(llama(input_ids, attention_mask=attention_mask).logits[real],
                                   plat(input_ids, attention_mask=attention_mask).logits[real], atol=1e-5, rtol=1e-4)
    generate = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(llama.generate(input_ids, **generate), plat.generate(input_ids, **generate))


def test_save_and_reload(tmp_path):
    model = family("qwen3", "plap", plap_p=[1.5, 2.5, 1.5, 2.5], plap_eps=1e-4, plap_formulation="euler")
    input_ids, _ = batch()
    model.save_pretrained(tmp_path / "explicit")
    modeling_plat.mark_plap(model.config)
    model.save_pretrained(tmp_path / "marked")
    with torch.no_grad():
        expected = model(input_ids).logits
        for folder in ("explicit", "marked"):
            # The marked checkpoint says "attn_implementation": "plap" in its config.json; the other needs the argument.
            kwargs = {"attn_implementation": "plap"} if folder == "explicit" else {}
            reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder, **kwargs).to(DEVICE).eval()
            assert reloaded.config._attn_implementation == "plap"
            assert (reloaded.config.plap_p, reloaded.config.plap_eps) == ([1.5, 2.5, 1.5, 2.5], 1e-4)
            torch.testing.assert_close(reloaded(input_ids).logits, expected)


def test_config_changes_take_effect_at_the_next_call():
    """Each layer keeps its settings between calls, and reads them again when a field changes, in place too."""
    model = family("llama3", "plap", plap_p=[2.0] * 4)
    input_ids, _ = batch()
    with torch.no_grad():
        softmax = model(input_ids).logits
        model.config.plap_p[0] = 1.5
        torch.testing.assert_close(model(input_ids).logits,
                                   family("llama3", "plap", plap_p=[1.5, 2.0, 2.0, 2.0])(input_ids).logits)
        model.config.plap_formulation = "euler"
        torch.testing.assert_close(model(input_ids).logits, family(
            "llama3", "plap", plap_p=[1.5, 2.0, 2.0, 2.0], plap_formulation="euler")(input_ids).logits)
        model.config.plap_p = 2.0
        torch.testing.assert_close(model(input_ids).logits, softmax)


def test_trains():
    model = family("llama3", "plap").train()
    input_ids, attention_mask = batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_vit_matches_eager_and_platforimageclassification():
    config = ViTConfig(num_hidden_layers=2, hidden_size=24, num_attention_heads=3, intermediate_size=48, image_size=16,
                       patch_size=4, num_labels=5)
    torch.manual_seed(0)
    eager = ViTForImageClassification._from_config(copy.deepcopy(config), attn_implementation="eager").to(DEVICE).eval()
    pixels = torch.randn(2, 3, 16, 16, device=DEVICE)
    with torch.no_grad():
        expected = eager(pixels).logits
        for plap_p in (2.0, [1.5, 1.5, 2.5]):
            plap = ViTForImageClassification._from_config(copy.deepcopy(config), attn_implementation="plap").to(DEVICE)
            plap.load_state_dict(eager.state_dict())
            plap.config.plap_p = plap_p
            reference = expected if plap_p == 2.0 else convert_to_plat(eager, plap_p=plap_p)(pixels).logits
            torch.testing.assert_close(plap.eval()(pixels).logits, reference, atol=1e-5, rtol=1e-4)
    assert isinstance(convert_to_plat(eager), PlatForImageClassification)


@pytest.mark.parametrize("model_class", [DeiTForImageClassification, DeiTForImageClassificationWithTeacher])
def test_deit_matches_eager_at_p2(model_class):
    """DeiT's own classes (the distilled one's extra token too) at p = 2 are DeiT; the paper's mix changes them."""
    config = DeiTConfig(num_hidden_layers=2, hidden_size=24, num_attention_heads=3, intermediate_size=48,
                        image_size=16, patch_size=4, num_labels=5)
    torch.manual_seed(0)
    eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").to(DEVICE).eval()
    plap = model_class._from_config(copy.deepcopy(config), attn_implementation="plap").to(DEVICE).eval()
    plap.load_state_dict(eager.state_dict())
    pixels = torch.randn(2, 3, 16, 16, device=DEVICE)
    with torch.no_grad():
        expected = eager(pixels).logits
        mix = plap(pixels).logits
        plap.config.plap_p = 2.0
        torch.testing.assert_close(plap(pixels).logits, expected, atol=1e-5, rtol=1e-4)
    assert (mix - expected).abs().max() > 1e-3


def test_gemma2_softcapping_is_refused_by_name():
    model = family("gemma2", "plap", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        model(batch()[0])


def test_p_that_does_not_match_the_heads_is_refused():
    with pytest.raises(ValueError, match="one value per head"):
        family("qwen2.5", "plap", plap_p=[1.5, 2.5])(batch()[0])
    with pytest.raises(ValueError, match="num_hidden_layers"):
        family("qwen2.5", "plap", plap_p=[[1.5] * 4] * 3)(batch()[0])


def test_cross_attention_is_refused():
    config = BartConfig(vocab_size=61, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    model = BartModel._from_config(config, attn_implementation="plap").to(DEVICE).eval()
    ids = torch.randint(3, 61, (1, 8), device=DEVICE)
    for decoder_ids in (ids[:, :5], ids):  # the same length too: the decoder's non-causal attention is the cross one
        with pytest.raises(ValueError, match="cross-attention"):
            model(input_ids=ids, decoder_input_ids=decoder_ids)


def test_cross_attention_classes_are_refused_at_equal_lengths():
    """BERT's family builds cross-attention as its own class (a decoder attending to encoder states of its length)."""
    config = BertGenerationConfig(vocab_size=61, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, is_decoder=True,
                                  add_cross_attention=True)  # fmt: skip
    model = BertGenerationDecoder._from_config(config, attn_implementation="plap").to(DEVICE).eval()
    ids = torch.randint(3, 61, (1, 8), device=DEVICE)
    with pytest.raises(ValueError, match="CrossAttention .*cross-attention"):
        model(input_ids=ids, encoder_hidden_states=torch.randn(1, 8, 16, device=DEVICE))
    model(input_ids=ids)  # its causal self-attention alone runs


def test_static_cache_is_refused():
    with pytest.raises(ValueError, match="static cache"):
        family("llama3", "plap").generate(batch()[0], max_new_tokens=2, cache_implementation="static")


def test_mask_is_key_padding_or_none_for_plain_patterns():
    """Causal masks reach the fused kernels as None or (B, 1, 1, Nk): the module's is_causal adds causality."""
    padding = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool, device=DEVICE)
    assert plap_mask(2, 4, 4, attention_mask=torch.ones_like(padding), device=DEVICE) is None
    assert torch.equal(plap_mask(2, 4, 4, attention_mask=padding, device=DEVICE), padding[:, None, None, :])


@pytest.mark.slow
def test_compiles_without_graph_breaks():
    model = family("qwen3", "plap")
    input_ids, attention_mask = batch()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(input_ids, attention_mask=attention_mask).logits, expected,
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name, padded", [("mistral-window", True), ("qwen3", False),
                                          pytest.param("llama4-chunked", True, marks=pytest.mark.slow)])
def test_windows_chunks_and_possible_packing_break_the_graph_only_where_the_mask_is_made(name, padded):
    """torch.compile cannot trace how plap_mask tells a sliding window, chunks or packed rows apart: it calls that
    outside its graphs, once per mask, and traces the layers whole around it; the compiled model gives the eager
    logits. Without an attention mask or a cache every traced call counts as packed rows (transformers cannot read
    position_ids on the host while it traces), and an attention mask of ones keeps plain causal attention whole
    (fullgraph)."""
    model = family(name, "plap", use_cache=False)
    input_ids, attention_mask = batch()
    inputs = dict(attention_mask=attention_mask) if padded else {}
    with torch.no_grad():
        expected = model(input_ids, **inputs).logits
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(input_ids, **inputs)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")(input_ids, **inputs).logits
        if not padded:
            torch._dynamo.reset()
            whole = torch.compile(model, backend="aot_eager", fullgraph=True)
            torch.testing.assert_close(whole(input_ids, attention_mask=torch.ones_like(input_ids)).logits, expected,
                                       atol=1e-5, rtol=1e-4)
    assert explained.break_reasons and all(reason.user_stack[-1].name == "plap_mask"
                                           for reason in explained.break_reasons)  # fmt: skip
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-4)


PACKED_LENGTHS = (5, 11, 1, 9)


# Llama 4 without a cache only: with one, transformers' chunked mask counts chunks from the row's start.
PACKED_CASES = [("qwen3", False), ("qwen3", True), ("mistral-window", False), ("mistral-window", True),
                ("llama4-chunked", False)]


@pytest.mark.parametrize("boundaries", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("backend", ["eager", "tiled", "triton"])
@pytest.mark.parametrize("name, use_cache", PACKED_CASES,
                         ids=[f"{name}-{'inference' if cache else 'training'}" for name, cache in PACKED_CASES])
def test_packed_rows_get_each_document_alone(name, use_cache, backend, boundaries):
    """DataCollatorWithFlattening's rows: every document gets the logits it gets alone, with each backend; an
    explicit "triton" runs the fused kernels (it refuses a (B, 1, N, N) mask), so the documents reach them as ids,
    Mistral's window as its size and Llama 4's chunks of each document as ids too. Without a cache transformers builds
    a packed mask, which plap_mask leaves to the ids; with one it builds a plain causal mask, and only the
    position_ids (or cu_seq_lens) tell the documents."""
    if backend == "triton":
        pytest.importorskip("triton")
    model = family(name, "plap", plap_backend=backend)
    documents = [torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in PACKED_LENGTHS]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=boundaries, return_tensors="pt")
    batch = collator([{"input_ids": document} for document in documents])
    batch = {key: value.to(DEVICE) for key, value in batch.items() if key not in ("max_length_q", "max_length_k")}
    batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch, use_cache=use_cache).logits
        start = 0
        for document in documents:
            alone = model(torch.tensor([document], device=DEVICE)).logits
            torch.testing.assert_close(logits[:, start : start + len(document)], alone, atol=2e-5, rtol=1e-4)
            start += len(document)
