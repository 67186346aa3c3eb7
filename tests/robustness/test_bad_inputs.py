"""Bad inputs and bad configurations: each must end in a clear ValueError naming the argument."""

import pytest
import torch
from transformers import StaticCache

from modeling_plat.modeling_plat import _check_range
from tiny import LLAMA_SHAPE, classifier, lm, text_config, vision_config


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(plap_p=0.5), ">= 1"),
        (dict(plap_p=float("nan")), "finite"),
        (dict(plap_p=[1.5, 2.5]), "one value per head"),
        (dict(plap_p=[[1.5] * 4]), "list of lists"),
        (dict(plap_p="1.5"), "must be a number"),
        (dict(plap_eps=0.0), "plap_eps"),
        (dict(plap_eps=-1e-6), "plap_eps"),
        (dict(plap_formulation="implicit"), "plap_formulation"),
        (dict(plap_backend="cuda-magic"), "plap_backend"),
        (dict(hidden_size=30), "divisible"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        text_config(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(image_size=30, patch_size=16), "multiple of patch_size"),
        (dict(num_channels=0), "num_channels"),
        (dict(plap_p=[1.5, 2.5]), "one value per head"),
    ],
)
def test_vision_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        vision_config(**kwargs)


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda m: m(torch.tensor([[1, 2, 61]])), "input_ids must lie in"),
        (lambda m: m(torch.tensor([[1, -2, 3]])), "input_ids must lie in"),
        (lambda m: m(torch.ones(1, 41, dtype=torch.long)), "max_position_embeddings"),
        (lambda m: m(torch.ones(2, 0, dtype=torch.long)), "Empty input"),
        (lambda m: m(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4)), "attention_mask"),
        (lambda m: m(torch.ones(2, 5, dtype=torch.long), labels=torch.ones(2, 4, dtype=torch.long)), "labels"),
        (lambda m: m(), "exactly one of"),
        (lambda m: m(torch.ones(5, dtype=torch.long)), "batch, length"),
    ],
)
def test_lm_bad_input_raises_clear_errors(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call(lm())


def test_llama_shape_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="input_ids must lie in"):
        lm(**LLAMA_SHAPE)(torch.tensor([[1, 2, 61]]))


@pytest.mark.parametrize("shape", [{}, LLAMA_SHAPE])
def test_static_cache_is_refused_up_front(shape):
    model = lm(**shape)
    with pytest.raises(ValueError, match="p-LaT needs a DynamicCache"):
        model.generate(torch.randint(2, 61, (2, 5)), max_new_tokens=3, cache_implementation="static")
    with pytest.raises(ValueError, match="DynamicCache"):
        model(torch.randint(2, 61, (1, 3)), cache=StaticCache(config=model.config, max_cache_len=8))


def test_range_checks_read_no_device_tensor():
    """Reading a GPU tensor's min/max would synchronise the host on every forward, every generated token
    included: only CPU tensors are range-checked (a meta tensor has no values to read, and must not be read)."""
    _check_range("input_ids", torch.full((1, 3), 99, device="meta"), 0, 61, "vocab_size")
    with pytest.raises(ValueError, match="input_ids must lie in"):
        _check_range("input_ids", torch.full((1, 3), 99), 0, 61, "vocab_size")


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda m: m(torch.randn(2, 1, 16, 16)), "num_channels=3"),
        (lambda m: m(torch.randn(2, 3, 20, 20)), "interpolate_pos_encoding"),
        (lambda m: m(torch.randn(2, 3, 18, 18), interpolate_pos_encoding=True), "multiples of patch_size"),
        (lambda m: m(torch.randn(3, 16, 16)), "pixel_values must be"),
        (lambda m: m(torch.randn(0, 3, 16, 16)), "Empty batch"),
        (lambda m: m(torch.randn(2, 3, 16, 16), labels=torch.tensor([1, 7])), "labels must lie in"),
        (lambda m: m(torch.randn(2, 3, 16, 16), labels=torch.tensor([1, 2, 3])), "batch size"),
    ],
)
def test_classifier_bad_input_raises_clear_errors(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call(classifier())


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda m: m(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 1, 5)), "attention_mask"),
        (lambda m: m(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(3, 5)), "attention_mask"),
        (lambda m: m(inputs_embeds=torch.randn(2, 5, 7)), "inputs_embeds"),
        (lambda m: m(torch.ones(1, 3, dtype=torch.long), inputs_embeds=torch.randn(1, 3, 32)), "exactly one of"),
    ],
)
def test_lm_mismatched_shapes_raise_clear_errors(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call(lm())


def test_newer_config_version_is_refused():
    with pytest.raises(ValueError, match="newer plat"):
        text_config(plat_config_version=99)
