"""Saved checkpoints load through Hub remote code in a fresh process where the plugin cannot be imported."""

import json
import textwrap

import pytest
import torch

from modeling_plat import PlatConfig, PlatForCausalLM, PlatForImageClassification, PlatVisionConfig
from tiny import LLAMA_SHAPE, run_without_plugin

# Runs where plat cannot be imported: loads with trust_remote_code and saves the outputs.
LOADER = textwrap.dedent(
    """
    import torch
    from transformers import {auto}, AutoModel
    folder, inputs_path, out_path = sys.argv[1:]
    model = {auto}.from_pretrained(folder, trust_remote_code=True).eval()
    assert "transformers_modules" in type(model).__module__, type(model).__module__
    trunk = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert type(trunk).__name__ == "{trunk}", type(trunk).__name__
    # Trainer's label smoothing shifts the labels of the causal LMs listed there (test_modeling.py checks the loss).
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    causal = type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    assert causal == ("{auto}" == "AutoModelForCausalLM"), causal
    with torch.no_grad():
        logits = model(torch.load(inputs_path)).logits
    torch.save(logits, out_path)
    """
)


@pytest.mark.parametrize("family", ["text", "llama", "vision"])
def test_trust_remote_code_in_fresh_process(tmp_path, family):
    torch.manual_seed(0)
    if family in ("text", "llama"):
        config = PlatConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            plap_p=[1.5, 1.5, 2.5, 2.5], max_position_embeddings=32,
                            **(LLAMA_SHAPE if family == "llama" else {}))
        model, inputs = PlatForCausalLM(config), torch.randint(0, 50, (2, 9))
        auto, trunk = "AutoModelForCausalLM", "PlatModel"
    else:
        config = PlatVisionConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, image_size=16,
                            patch_size=4, num_labels=4, plap_formulation="euler")
        model, inputs = PlatForImageClassification(config), torch.randn(2, 3, 16, 16)
        auto, trunk = "AutoModelForImageClassification", "PlatVisionModel"
    folder = tmp_path / "checkpoint"
    model.eval().save_pretrained(folder)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == f"configuration_plat.{type(config).__name__}"
    assert auto_map[auto] == f"modeling_plat.{type(model).__name__}"
    assert {"modeling_plat.py", "configuration_plat.py", "plap_dispatch.py"} <= {p.name for p in folder.iterdir()}

    # The fresh process loads on the CPU (from_pretrained's default) in an environment of transformers alone; the
    # comparison is bit for bit, so the model here computes on the CPU too, on any machine: the same kernels.
    torch.save(inputs, tmp_path / "inputs.pt")
    result = run_without_plugin(LOADER.format(auto=auto, trunk=trunk), tmp_path, folder, tmp_path / "inputs.pt",
                                tmp_path / "out.pt")
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = model(inputs).logits
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)
