"""Damaged checkpoints fail loudly and whole: never a half-loaded model."""

import json

import pytest

from modeling_plat import PlatForCausalLM
from tiny import lm


@pytest.fixture
def checkpoint(tmp_path):
    lm().save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("keep", [0.5, 0.99, 4])
def test_truncated_weights_raise_a_clear_error(checkpoint, keep):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(OSError, match="truncated or corrupt"):
        PlatForCausalLM.from_pretrained(checkpoint)


def test_garbage_weights_raise_a_clear_error(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(OSError, match="truncated or corrupt"):
        PlatForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"plat_config_version": 2}, "newer plat"),
        ({"plap_p": [1.5] * 5}, "one value per head"),
        ({"plap_backend": "flash9"}, "plap_backend"),
        ({"plap_formulation": "implicit"}, "plap_formulation"),
        ({"num_attention_heads": 3}, "divisible"),
    ],
)
def test_incompatible_config_raises_a_clear_error(checkpoint, change, message):
    path = checkpoint / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ValueError, match=message):
        PlatForCausalLM.from_pretrained(checkpoint)
