"""convert_to_plat and its command line: same weights, same outputs at p = 2, clear errors otherwise; the models
compared on the tests' device (tests/device.py)."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from transformers import (
    DeiTConfig,
    DeiTForImageClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    ViTConfig,
    ViTModel,
)

from device import DEVICE
from modeling_plat import PlatForCausalLM, PlatVisionModel
from modeling_plat.convert import convert_to_plat
from plat_train import convert as convert_cli
from tiny import train_losses

VIT = dict(num_hidden_layers=2, hidden_size=24, num_attention_heads=3, intermediate_size=48, image_size=16,
           patch_size=4)


DECODER = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# GQA with 1, 2 and all 4 key/value heads; tied and untied embeddings; Qwen2's q/k/v biases; a non-default rope_theta;
# Llama with every attention and MLP bias and a head_dim that is not hidden / heads.
LLAMA_FAMILY = {
    "llama-gqa2-theta": (LlamaForCausalLM, LlamaConfig(**DECODER, num_key_value_heads=2, rope_theta=5e5)),
    "llama-biases-head_dim": (LlamaForCausalLM, LlamaConfig(**DECODER, num_key_value_heads=2, head_dim=12,
                                                            attention_bias=True, mlp_bias=True)),
    "qwen2-mqa-tied": (Qwen2ForCausalLM, Qwen2Config(**DECODER, num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral-mha": (MistralForCausalLM, MistralConfig(**DECODER, num_key_value_heads=4, sliding_window=None)),
    # A window of 4 keys, shorter than the inputs: every layer keeps it (PlatConfig.sliding_window).
    "mistral-window": (MistralForCausalLM, MistralConfig(**DECODER, num_key_value_heads=2, sliding_window=4)),
}


def llama_family(name):
    """A transformers Llama-family model with random weights, its biases (if any) non-zero."""
    model_class, config = LLAMA_FAMILY[name]
    torch.manual_seed(0)
    model = model_class(copy.deepcopy(config)).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(std=0.1)
    return model


@pytest.mark.parametrize("name", sorted(LLAMA_FAMILY))
def test_llama_family_converts_exactly_at_p2(name):
    source = llama_family(name).to(DEVICE)
    plat = convert_to_plat(source, plap_p=2.0).to(DEVICE)
    config = plat.config
    assert config.num_key_value_heads == source.config.num_key_value_heads
    assert config.sliding_window == getattr(source.config, "sliding_window", None)
    assert config.rope_parameters["rope_theta"] == source.config.rope_parameters["rope_theta"]
    assert (plat.lm_head.weight is plat.model.embed_tokens.weight) == source.config.tie_word_embeddings
    ids = torch.randint(3, 61, (3, 11)).to(DEVICE)
    torch.testing.assert_close(plat(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-5)
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :2] = 0  # left padding
    padded, expected = plat(ids, attention_mask=mask).logits, source(ids, attention_mask=mask).logits
    torch.testing.assert_close(padded[mask.bool()], expected[mask.bool()], rtol=1e-5, atol=1e-5)
    greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=True)
    assert torch.equal(plat.generate(ids, **greedy), source.generate(ids, **greedy))
    assert not torch.allclose(convert_to_plat(source).to(DEVICE)(ids).logits, source(ids).logits, atol=1e-3)


@pytest.mark.parametrize("model_class, config, field", [
    # Windows in some layers only (Qwen2's use_sliding_window from max_window_layers on).
    (Qwen2ForCausalLM, Qwen2Config(**DECODER, use_sliding_window=True, sliding_window=16, max_window_layers=1),
     "layer_types"),
    (Qwen2ForCausalLM, Qwen2Config(**DECODER, num_experts=4), "num_experts=4"),  # a Llama-family class with experts
    (MixtralForCausalLM, MixtralConfig(**DECODER, num_local_experts=4, sliding_window=None), "MixtralForCausalLM"),
])
def test_unrepresentable_llama_family_settings_are_refused_before_copying(model_class, config, field, monkeypatch):
    torch.manual_seed(0)
    source = model_class(config)
    monkeypatch.setattr(PlatForCausalLM, "load_state_dict", lambda *a, **k: pytest.fail("weights were copied"))
    with pytest.raises(ValueError, match=field):
        convert_to_plat(source)


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=61, n_positions=40,
                                      bos_token_id=0, eos_token_id=0)).eval()


def test_vit_model_trunk_converts_exactly():
    torch.manual_seed(0)
    vit = ViTModel(ViTConfig(**VIT)).eval().to(DEVICE)
    plat = convert_to_plat(vit, plap_p=2.0).to(DEVICE)
    assert isinstance(plat, PlatVisionModel)
    pixels = torch.randn(2, 3, 16, 16).to(DEVICE)
    torch.testing.assert_close(plat(pixels).last_hidden_state, vit(pixels).last_hidden_state, rtol=1e-5, atol=1e-5)


def test_converted_paper_mix_trains():
    plat = convert_to_plat(tiny_gpt2(), plap_p=[1.5, 1.5, 2.5, 2.5]).to(DEVICE)
    assert plat.config.plap_p == [1.5, 1.5, 2.5, 2.5]
    ids = torch.randint(0, 61, (4, 16)).to(DEVICE)
    losses = train_losses(plat, 8, 1e-3, input_ids=ids, labels=ids)
    assert losses[-1] < losses[0]


def test_unsupported_sources_raise_clear_errors():
    torch.manual_seed(0)
    deit = DeiTForImageClassification(DeiTConfig(**VIT, num_labels=3))
    with pytest.raises(ValueError, match="Cannot convert DeiTForImageClassification"):
        convert_to_plat(deit)
    odd = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8,
                                     scale_attn_by_inverse_layer_idx=True, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        convert_to_plat(odd)


def test_cli_converts_a_qwen2_checkpoint(tmp_path):
    source, output = tmp_path / "qwen2", tmp_path / "plat"
    qwen2 = llama_family("qwen2-mqa-tied")
    qwen2.save_pretrained(source)
    result = subprocess.run(
        [sys.executable, "-m", "plat_train.convert", "--source", str(source), "--output", str(output),
         "--config_overrides", "plap_p=2.0"], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Llama-style" in (output / "README.md").read_text()
    plat, qwen2 = PlatForCausalLM.from_pretrained(output).eval().to(DEVICE), qwen2.to(DEVICE)
    ids = torch.randint(3, 61, (2, 9)).to(DEVICE)
    torch.testing.assert_close(plat(ids).logits, qwen2(ids).logits, rtol=1e-5, atol=1e-5)


def test_cli_round_trip(tmp_path):
    source = tmp_path / "gpt2"
    gpt2 = tiny_gpt2()
    gpt2.save_pretrained(source)
    output = tmp_path / "plat"
    result = subprocess.run(
        [sys.executable, "-m", "plat_train.convert", "--source", str(source), "--output", str(output),
         "--config_overrides", "plap_p=2.0"], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((output / "config.json").read_text())
    assert config["model_type"] == "plat" and config["plap_p"] == 2.0
    assert "base_model: " + str(source) in (output / "README.md").read_text()
    plat, gpt2 = PlatForCausalLM.from_pretrained(output).eval().to(DEVICE), gpt2.to(DEVICE)
    ids = torch.randint(0, 61, (2, 9)).to(DEVICE)
    torch.testing.assert_close(plat(ids).logits, gpt2(ids).logits, rtol=1e-5, atol=1e-5)


def saved(config, folder):
    config.save_pretrained(folder)
    return folder


# What each source folder holds, the flags after --source and --output, and the error.
CLI_REFUSALS = {
    "a folder that is not there": (lambda folder: folder / "nowhere", [], "--source {folder}/nowhere: no such folder"),
    "a folder without a config": (lambda folder: folder, [], "Unrecognized model in {folder}"),
    "a family that does not convert": (lambda folder: saved(MixtralConfig(**DECODER), folder), [],
                                       "Cannot convert a MixtralConfig (model_type 'mixtral')"),
    "overrides p-LaT refuses": (lambda folder: saved(GPT2Config(n_layer=1, n_embd=8, n_head=2), folder),
                                ["--config_overrides", "n_layr=1"],
                                "--config_overrides names fields that PlatConfig does not have: ['n_layr']"),
}  # fmt: skip


@pytest.mark.parametrize("source, flags, message", CLI_REFUSALS.values(), ids=CLI_REFUSALS)
def test_cli_refuses_a_source_it_cannot_convert_in_one_line(source, flags, message, tmp_path, capsys):
    """Exit status 2 and the reason on stderr, before anything is converted or written."""
    folder = tmp_path / "source"
    folder.mkdir()
    with pytest.raises(SystemExit) as stop:
        convert_cli.main(["--source", str(source(folder)), "--output", str(tmp_path / "out"), *flags])
    assert stop.value.code == 2
    assert "plat-convert: error: " + message.format(folder=folder) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_converted_model_lands_where_its_source_computes():
    source = tiny_gpt2().to(DEVICE, torch.float64)
    plat = convert_to_plat(source, plap_p=2.0)
    assert {(t.device, t.dtype) for t in plat.state_dict().values()} == {(source.lm_head.weight.device, torch.float64)}
    ids = torch.randint(3, 61, (2, 9)).to(DEVICE)
    torch.testing.assert_close(plat(ids).logits, source(ids).logits)
