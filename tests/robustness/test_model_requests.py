"""Requests a p-LaT model cannot honour are refused up front with a clear ValueError: generating past its learned
positions, and another attention implementation (the p-LaT one is chosen by the saved ``plap_backend``). Models that
compute do so on the tests' device (tests/device.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageClassification

from device import DEVICE
from tiny import classifier, lm, text_config
from modeling_plat import PlatForCausalLM


def test_generate_past_the_learned_positions_is_refused_before_the_first_token():
    model = lm().to(DEVICE)  # max_position_embeddings=40
    prompt = torch.randint(2, 61, (1, 30)).to(DEVICE)
    with pytest.raises(ValueError, match="at most 10 new tokens"):
        model.generate(prompt, max_new_tokens=11, do_sample=False)
    assert model.generate(prompt, max_new_tokens=10, do_sample=False).shape == (1, 40)
    # Without max_new_tokens, transformers' default length already stops at the last position.
    assert model.generate(prompt, do_sample=False).shape == (1, 40)


@pytest.mark.parametrize("implementation", ["sdpa", "flash_attention_2", "flex_attention"])
def test_other_attention_implementations_point_to_plap_backend(implementation, tmp_path):
    for model, auto_class in ((lm(), AutoModelForCausalLM), (classifier(), AutoModelForImageClassification)):
        model.save_pretrained(tmp_path / model.config.model_type)
        with pytest.raises(ValueError, match="plap_backend"):
            auto_class.from_pretrained(tmp_path / model.config.model_type, attn_implementation=implementation)
        with pytest.raises(ValueError, match="plap_backend"):
            model.set_attn_implementation(implementation)
    with pytest.raises(ValueError, match="plap_backend"):
        PlatForCausalLM(text_config(attn_implementation=implementation))


def test_eager_attention_is_accepted_and_changes_nothing(tmp_path):
    model = lm().to(DEVICE)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").to(DEVICE)
    reloaded.set_attn_implementation("eager")
    ids = torch.randint(2, 61, (2, 7)).to(DEVICE)
    # Exact: the same weights through the same kernels on the same device.
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
