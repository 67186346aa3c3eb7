"""Saved checkpoints load through Hub remote code in a fresh process where the plugin cannot be imported."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from modeling_plat import PlatConfig, PlatForCausalLM, PlatForImageClassification

# Runs in a subprocess: makes `import modeling_plat` fail, loads with trust_remote_code, saves the outputs.
LOADER = textwrap.dedent(
    """
    import sys
    sys.modules["modeling_plat"] = None  # the plugin is not importable here
    import torch
    from transformers import {auto}, AutoModel
    folder, inputs_path, out_path = sys.argv[1:]
    model = {auto}.from_pretrained(folder, trust_remote_code=True).eval()
    assert "transformers_modules" in type(model).__module__, type(model).__module__
    trunk = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert type(trunk).__name__ == "{trunk}", type(trunk).__name__
    with torch.no_grad():
        logits = model(torch.load(inputs_path)).logits
    torch.save(logits, out_path)
    """
)


@pytest.mark.parametrize("family", ["text", "vision"])
def test_trust_remote_code_in_fresh_process(tmp_path, family):
    torch.manual_seed(0)
    if family == "text":
        config = PlatConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            plap_p=[1.5, 1.5, 2.5, 2.5], max_position_embeddings=32)
        model, inputs = PlatForCausalLM(config), torch.randint(0, 50, (2, 9))
        auto, trunk = "AutoModelForCausalLM", "PlatModel"
    else:
        config = PlatConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, image_size=16,
                            patch_size=4, num_labels=4, plap_formulation="euler")
        model, inputs = PlatForImageClassification(config), torch.randn(2, 3, 16, 16)
        auto, trunk = "AutoModelForImageClassification", "PlatVisionModel"
    folder = tmp_path / "checkpoint"
    model.eval().save_pretrained(folder)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_plat.PlatConfig"
    assert auto_map[auto] == f"modeling_plat.{type(model).__name__}"
    assert {"modeling_plat.py", "configuration_plat.py", "plap_attention.py"} <= {p.name for p in folder.iterdir()}

    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "load.py"
    script.write_text(LOADER.format(auto=auto, trunk=trunk))
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, str(script), str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = model(inputs).logits
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)
