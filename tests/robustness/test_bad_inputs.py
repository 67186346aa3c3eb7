"""Bad inputs and bad configurations: each must end in a clear ValueError naming the argument; on the tests' device
(tests/device.py), except the index range checks, which exist for CPU tensors only."""

import pytest
import torch
from transformers import StaticCache

from device import DEVICE, ON_CUDA

from modeling_plat.modeling_plat import _check_range
from modeling_plat.plap_attention_decode import plap_attention_decode
from modeling_plat.plap_attention_reference import FORMULATIONS, implemented
from modeling_plat.plap_attention_tiled import plap_attention_tiled
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


# Indices out of range are found by a host read that only CPU tensors get (_check_range: on a GPU it would synchronise
# every forward). A GPU tensor's bad index reaches the embedding or the loss as a device-side assert, after which the
# CUDA context is lost to every later test: these calls are made on the CPU on every machine.
@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda: lm()(torch.tensor([[1, 2, 61]])), "input_ids must lie in"),
        (lambda: lm()(torch.tensor([[1, -2, 3]])), "input_ids must lie in"),
        (lambda: lm()(torch.ones(1, 41, dtype=torch.long)), "max_position_embeddings"),
        (lambda: classifier()(torch.randn(2, 3, 16, 16), labels=torch.tensor([1, 7])), "labels must lie in"),
    ],
)
def test_out_of_range_indices_raise_clear_errors_on_the_cpu(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call()


def ids(*shape):
    return torch.ones(*shape, dtype=torch.long, device=DEVICE)


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda m: m(ids(2, 0)), "Empty input"),
        (lambda m: m(ids(2, 5), attention_mask=torch.ones(2, 4, device=DEVICE)), "attention_mask"),
        (lambda m: m(ids(2, 5), labels=ids(2, 4)), "labels"),
        (lambda m: m(), "exactly one of"),
        (lambda m: m(ids(5)), "batch, length"),
    ],
)
def test_lm_bad_input_raises_clear_errors(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call(lm().to(DEVICE))


def test_llama_shape_bad_input_raises_clear_errors():
    # On the CPU, as test_out_of_range_indices_raise_clear_errors_on_the_cpu says.
    with pytest.raises(ValueError, match="input_ids must lie in"):
        lm(**LLAMA_SHAPE)(torch.tensor([[1, 2, 61]]))


@pytest.mark.parametrize("shape", [{}, LLAMA_SHAPE])
def test_static_cache_is_refused_up_front(shape):
    model = lm(**shape).to(DEVICE)
    with pytest.raises(ValueError, match="p-LaT needs a DynamicCache"):
        model.generate(torch.randint(2, 61, (2, 5)).to(DEVICE), max_new_tokens=3, cache_implementation="static")
    with pytest.raises(ValueError, match="DynamicCache"):
        model(torch.randint(2, 61, (1, 3)).to(DEVICE), cache=StaticCache(config=model.config, max_cache_len=8))


def test_range_checks_read_no_device_tensor():
    """Reading a GPU tensor's min/max would synchronise the host on every forward, every generated token
    included: only CPU tensors are range-checked (a meta tensor has no values to read, and must not be read)."""
    _check_range("input_ids", torch.full((1, 3), 99, device="meta"), 0, 61, "vocab_size")
    with pytest.raises(ValueError, match="input_ids must lie in"):
        _check_range("input_ids", torch.full((1, 3), 99), 0, 61, "vocab_size")
    if ON_CUDA:  # CUDA's sync debug mode turns any host read of the tensor into an error
        on_gpu = torch.full((1, 3), 99, device=DEVICE)
        torch.cuda.set_sync_debug_mode("error")
        try:
            _check_range("input_ids", on_gpu, 0, 61, "vocab_size")
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda m: m(torch.randn(2, 1, 16, 16).to(DEVICE)), "num_channels=3"),
        (lambda m: m(torch.randn(2, 3, 20, 20).to(DEVICE)), "interpolate_pos_encoding"),
        (lambda m: m(torch.randn(2, 3, 18, 18).to(DEVICE), interpolate_pos_encoding=True),
         "multiples of patch_size"),
        (lambda m: m(torch.randn(3, 16, 16).to(DEVICE)), "pixel_values must be"),
        (lambda m: m(torch.randn(0, 3, 16, 16).to(DEVICE)), "Empty batch"),
        (lambda m: m(torch.randn(2, 3, 16, 16).to(DEVICE), labels=torch.tensor([1, 2, 3], device=DEVICE)),
         "batch size"),
    ],
)
def test_classifier_bad_input_raises_clear_errors(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call(classifier().to(DEVICE))


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda m: m(ids(2, 5), attention_mask=torch.ones(2, 1, 5, device=DEVICE)), "attention_mask"),
        (lambda m: m(ids(2, 5), attention_mask=torch.ones(3, 5, device=DEVICE)), "attention_mask"),
        (lambda m: m(inputs_embeds=torch.randn(2, 5, 7).to(DEVICE)), "inputs_embeds"),
        (lambda m: m(ids(1, 3), inputs_embeds=torch.randn(1, 3, 32).to(DEVICE)), "exactly one of"),
    ],
)
def test_lm_mismatched_shapes_raise_clear_errors(make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call(lm().to(DEVICE))


def test_newer_config_version_is_refused():
    with pytest.raises(ValueError, match="newer plat"):
        text_config(plat_config_version=99)


@pytest.mark.parametrize("backend", [plap_attention_decode, plap_attention_tiled])
def test_fast_backends_called_directly_refuse_formulations_they_do_not_implement(backend):
    """Their code computes paper or euler; any other name would silently get one of those."""
    q = torch.randn(1, 2, 3, 4, device=DEVICE)
    for name in FORMULATIONS:
        if name in ("paper", "euler"):
            assert backend(q, q, q, p=(1.5, 2.5), formulation=name).shape == q.shape
        else:
            with pytest.raises(ValueError, match=f"implements the formulations \\('paper', 'euler'\\), not '{name}'"):
                backend(q, q, q, p=(1.5, 2.5), formulation=name)


def test_a_backend_cannot_declare_a_formulation_the_reference_lacks():
    with pytest.raises(ValueError, match="'hybrid'"):
        implemented("paper", "hybrid")
