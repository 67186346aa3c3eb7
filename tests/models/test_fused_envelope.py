"""Where users go, the fused kernels go: what ``auto`` chooses on NVIDIA GPUs for real transformers models.

Each scenario runs a tiny bfloat16 model on the CPU; at every attention call the dispatcher is asked what ``auto``
would choose for the same inputs on an A100 (8.0), an H100 (9.0), a B200 (10.0) and an RTX 5090 (12.0). Every
prefill and training call must get the fused kernels, every decoding call the decode path or the kernels: left
padding, a sliding window shorter than the input, Gemma 3 (head size 256, alternating windows), Llama 4's chunks
shorter than the input, Phi-3, packed rows
(both of DataCollatorWithFlattening's forms, through transformers' models and PlatForCausalLM), generation and ViT;
float32 models at head sizes 128 and 256 too.
"""

import pytest
import torch
from tiny import TINY_DECODER, lm
from transformers import (
    DataCollatorWithFlattening,
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
    Qwen3Config,
    Qwen3ForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

from modeling_plat import plap_dispatch
from modeling_plat.plap_attention_decode import DECODE_MAX_QUERIES

GPUS = {"A100": (8, 0), "H100": (9, 0), "B200": (10, 0), "RTX 5090": (12, 0)}
DECODER = dict(TINY_DECODER, hidden_size=64, intermediate_size=96, max_position_embeddings=128)  # head size 16
LENGTH = 40


@pytest.fixture
def choices(monkeypatch):
    """(queries, {GPU: backend auto chooses there}) of every attention call the dispatcher sees."""
    seen = []
    choose = plap_dispatch.choose_backend

    def spy(backend, query, key, value, **kwargs):
        simulated = {}
        for gpu, capability in GPUS.items():
            platform = plap_dispatch.Platform("cuda", capability, 1, False)
            simulated[gpu] = choose("auto", query, key, value, **{**kwargs, "platform": platform}).name
        seen.append((query.shape[-2], simulated))
        return choose(backend, query, key, value, **kwargs)

    monkeypatch.setattr(plap_dispatch, "choose_backend", spy)
    return seen


def decoder(model_class, config, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return model_class._from_config(config, attn_implementation="plap", dtype=dtype).eval()


def token_ids(batch=2):
    return torch.randint(3, 61, (batch, LENGTH), generator=torch.Generator().manual_seed(0))


def left_padded():
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return dict(input_ids=ids, attention_mask=mask)


def packed(boundaries):
    documents = [torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (17, 1, 30)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=boundaries, return_tensors="pt")(
        [{"input_ids": document} for document in documents]
    )
    return {key: value for key, value in batch.items() if key not in ("max_length_q", "max_length_k", "labels")}


SCENARIOS = {
    "llama-left-padding": (LlamaForCausalLM, LlamaConfig(**DECODER), left_padded),
    "mistral-window": (MistralForCausalLM, MistralConfig(**DECODER, sliding_window=16), left_padded),
    "gemma3-256": (Gemma3ForCausalLM, Gemma3TextConfig(**DECODER, head_dim=256, query_pre_attn_scalar=256,
                                                       sliding_window=16,
                                                       layer_types=["sliding_attention", "full_attention"]),
                   left_padded),
    "llama4-chunked": (Llama4ForCausalLM, Llama4TextConfig(**DECODER, attention_chunk_size=16, intermediate_size_mlp=96,
                                                           num_local_experts=2), left_padded),
    "phi3": (Phi3ForCausalLM, Phi3Config(**DECODER, partial_rotary_factor=0.5), left_padded),
    "qwen3-packed-position-ids": (Qwen3ForCausalLM, Qwen3Config(**DECODER, head_dim=32), lambda: packed(False)),
    "qwen3-packed-cu-seq-lens": (Qwen3ForCausalLM, Qwen3Config(**DECODER, head_dim=32), lambda: packed(True)),
}


def assert_fused(seen):
    assert seen
    for queries, chosen in seen:
        allowed = {"triton", "decode"} if queries <= DECODE_MAX_QUERIES else {"triton"}
        assert set(chosen.values()) <= allowed, (queries, chosen)


@pytest.mark.parametrize("use_cache", [False, True], ids=["training", "prefill"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_transformers_models_run_the_kernels(choices, name, use_cache):
    model_class, config, inputs = SCENARIOS[name]
    with torch.no_grad():
        decoder(model_class, config)(**inputs(), use_cache=use_cache)
    assert_fused(choices)


@pytest.mark.parametrize("name", ["llama-left-padding", "mistral-window", "gemma3-256", "llama4-chunked"])
def test_generation_runs_the_kernels_then_the_decode_path(choices, name):
    model_class, config, inputs = SCENARIOS[name]
    decoder(model_class, config).generate(**inputs(), max_new_tokens=3, do_sample=False)
    assert {queries > DECODE_MAX_QUERIES for queries, _ in choices} == {True, False}  # prefill and decoding
    assert_fused(choices)


@pytest.mark.parametrize("name", ["gemma3-256", "llama-128"])
def test_float32_models_run_the_kernels(choices, name):
    """Models trained in float32 (no autocast) at head sizes above 64: Gemma 3's 256 and Llama's 128."""
    model_class, config, inputs = {**SCENARIOS, "llama-128": (LlamaForCausalLM, LlamaConfig(**DECODER, head_dim=128),
                                                               left_padded)}[name]  # fmt: skip
    decoder(model_class, config, torch.float32)(**inputs(), use_cache=False).logits.sum().backward()
    assert_fused(choices)


def test_vit_runs_the_kernels(choices):
    torch.manual_seed(0)
    vit = ViTForImageClassification._from_config(
        ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, image_size=32,
                  patch_size=4),
        attn_implementation="plap", dtype=torch.bfloat16,
    )  # fmt: skip
    with torch.no_grad():
        vit(torch.randn(2, 3, 32, 32, dtype=torch.bfloat16))
    assert_fused(choices)


@pytest.mark.parametrize("boundaries", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_platforcausallm_packed_rows_run_the_kernels(choices, boundaries):
    model = lm(plap_p=[1.5, 1.5, 2.5, 2.0]).to(torch.bfloat16)
    with torch.no_grad():
        model(**packed(boundaries))
    assert_fused(choices)
