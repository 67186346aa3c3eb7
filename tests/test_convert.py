"""convert_to_plat and its command line: same weights, same outputs at p = 2, clear errors otherwise."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import DeiTConfig, DeiTForImageClassification, GPT2Config, GPT2LMHeadModel, ViTConfig, ViTModel

from modeling_plat import PlatForCausalLM, PlatVisionModel
from modeling_plat.convert import convert_to_plat
from tiny import train_losses

VIT = dict(num_hidden_layers=2, hidden_size=24, num_attention_heads=3, intermediate_size=48, image_size=16,
           patch_size=4)


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=61, n_positions=40,
                                      bos_token_id=0, eos_token_id=0)).eval()


def test_vit_model_trunk_converts_exactly():
    torch.manual_seed(0)
    vit = ViTModel(ViTConfig(**VIT)).eval()
    plat = convert_to_plat(vit, plap_p=2.0)
    assert isinstance(plat, PlatVisionModel)
    pixels = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(plat(pixels).last_hidden_state, vit(pixels).last_hidden_state, rtol=1e-5, atol=1e-5)


def test_converted_paper_mix_trains():
    plat = convert_to_plat(tiny_gpt2(), plap_p=[1.5, 1.5, 2.5, 2.5])
    assert plat.config.plap_p == [1.5, 1.5, 2.5, 2.5]
    ids = torch.randint(0, 61, (4, 16))
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
    plat = PlatForCausalLM.from_pretrained(output).eval()
    ids = torch.randint(0, 61, (2, 9))
    torch.testing.assert_close(plat(ids).logits, gpt2(ids).logits, rtol=1e-5, atol=1e-5)
