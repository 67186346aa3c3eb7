"""Rotary positions of the Llama shape: every rotary type of transformers, from the config and from converted Llama
checkpoints, and partial rotation, each equal at p = 2 to the transformers model that computes it; on the tests'
device (tests/device.py)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from device import DEVICE
from modeling_plat import PlatConfig, PlatForCausalLM
from modeling_plat.convert import convert_to_plat

DECODER = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA_SHAPE = dict(position_embedding_type="rope", norm_type="rmsnorm", mlp_type="gated", hidden_act="silu",
                   attention_bias=False, mlp_bias=False, tie_word_embeddings=False, plap_p=2.0)
# Each of transformers' rotary types with its fields, for a head_dim of 8 (longrope: one factor per frequency) and a
# trained length of 32 positions (original_max_position_embeddings) where the type has one.
ROPE_SCALING = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.5, 2.0, 3.0, 5.0],
                 "original_max_position_embeddings": 32},
}


def llama_with_rope(rope_type):
    torch.manual_seed(0)
    config = LlamaConfig(**DECODER, rope_parameters={**ROPE_SCALING[rope_type], "rope_theta": 1e4})
    return LlamaForCausalLM(config).eval().to(DEVICE)


def assert_computes_as(plat, source):
    """Logits within the trained length and past it (64 positions: dynamic and longrope switch frequencies there),
    and greedy decoding with the cache across it, equal the source's."""
    ids = torch.randint(3, 61, (2, 80), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for length in (20, 80):
        torch.testing.assert_close(plat(ids[:, :length]).logits, source(ids[:, :length]).logits, rtol=1e-5,
                                   atol=1e-5)  # fmt: skip
    greedy = dict(max_new_tokens=8, do_sample=False, use_cache=True)
    assert torch.equal(plat.generate(ids[:, :60], **greedy), source.generate(ids[:, :60], **greedy))


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALING))
def test_llama_with_rope_scaling_converts_exactly_at_p2(rope_type):
    llama = llama_with_rope(rope_type)
    plat = convert_to_plat(llama, plap_p=2.0).to(DEVICE)
    assert plat.config.rope_parameters == llama.config.rope_parameters
    assert_computes_as(plat, llama)


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALING))
def test_rope_scaling_from_the_config_computes_as_llama(rope_type):
    """A PlatConfig written by hand, given only the fields a user would write, with Llama's weights."""
    llama = llama_with_rope(rope_type)
    config = PlatConfig(**DECODER, **LLAMA_SHAPE, rope_parameters=ROPE_SCALING[rope_type])
    plat = convert_to_plat(llama, config=config).to(DEVICE)
    assert plat.model.rotary_emb.rope_type == rope_type
    assert_computes_as(plat, llama)


def test_partial_rotation_computes_as_phi3():
    """partial_rotary_factor rotates the first half of each head's features and keeps the rest, as Phi-3 does; its
    fused projections are split into ours."""
    torch.manual_seed(0)
    rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    phi3 = Phi3ForCausalLM(Phi3Config(**DECODER, rope_parameters=rope_parameters, rms_norm_eps=1e-6))
    phi3 = phi3.eval().to(DEVICE)
    config = PlatConfig(**DECODER, **LLAMA_SHAPE, partial_rotary_factor=0.5)
    plat = PlatForCausalLM(config).eval().to(DEVICE)
    state = {}
    for name, tensor in phi3.state_dict().items():
        name = name.replace("self_attn", "attention").replace("input_layernorm", "attn_norm")
        name = name.replace("post_attention_layernorm", "mlp_norm")
        if name.endswith("qkv_proj.weight"):
            sizes = [config.num_attention_heads * config.head_dim] + [config.num_key_value_heads * config.head_dim] * 2
            state.update(zip((name.replace("qkv", part) for part in "qkv"), tensor.split(sizes)))
        elif name.endswith("gate_up_proj.weight"):
            state.update(zip((name.replace("gate_up", part) for part in ("gate", "up")), tensor.chunk(2)))
        else:
            state[name] = tensor
    plat.load_state_dict(state)
    assert plat.model.rotary_emb.inv_freq.numel() == config.head_dim // 4  # a frequency per rotated feature pair
    assert_computes_as(plat, phi3)
