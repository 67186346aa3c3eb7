"""LoRA through PEFT, as the README shows it: plat's attention projections by name (PEFT knows no target modules
for an unknown model type), only the adapters (and the new classifier) train, and a saved adapter reloads onto a
fresh base model with the same outputs; on the tests' device (tests/device.py)."""

import pytest
import torch

from device import DEVICE
from tiny import classifier, lm, train_losses

peft = pytest.importorskip("peft")


def lora(model, **kwargs):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **kwargs)
    return peft.get_peft_model(model, config)


def test_lora_on_the_language_model_trains_the_adapters_only_and_reloads(tmp_path):
    model = lora(lm().to(DEVICE), task_type="CAUSAL_LM")
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert any("q_proj.lora_A" in name for name in trainable) and any("v_proj.lora_B" in name for name in trainable)

    ids = torch.randint(2, 61, (4, 12)).to(DEVICE)
    losses = train_losses(model, 5, 1e-2, input_ids=ids, labels=ids)
    assert losses[-1] < losses[0]
    model.eval()
    model.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(lm().to(DEVICE), tmp_path).eval()
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    assert reloaded.generate(ids[:1, :5], max_new_tokens=3, do_sample=False).shape == (1, 8)


def test_lora_on_the_vision_model_also_trains_the_classifier(tmp_path):
    model = lora(classifier().to(DEVICE), modules_to_save=["classifier"])
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert any("classifier" in name for name in trainable)
    assert all("lora_" in name or "classifier" in name for name in trainable)

    pixels, labels = torch.randn(6, 3, 16, 16).to(DEVICE), torch.arange(6, device=DEVICE) % 5
    losses = train_losses(model, 5, 1e-2, pixel_values=pixels, labels=labels)
    assert losses[-1] < losses[0]
    model.eval()
    model.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(classifier().to(DEVICE), tmp_path).eval()
    torch.testing.assert_close(reloaded(pixel_values=pixels).logits, model(pixel_values=pixels).logits)
