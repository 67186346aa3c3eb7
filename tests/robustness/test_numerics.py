"""Forward and backward stay finite at the edges: p at its bounds, coinciding tokens, padding-only rows,
large activations, long sequences and bf16 autocast (bf16 and fp16 on a GPU), for every backend that runs on
the tests' device (tests/device.py)."""

import pytest
import torch

from device import DEVICE, ON_CUDA, needs_cuda
from modeling_plat import BACKENDS, plap_attention
from modeling_plat.plap_dispatch import choose_backend
from modeling_plat.plap_attention_decode import DECODE_MAX_QUERIES
from spies import record_chosen_backends
from tiny import TEXT_SHAPES, classifier, lm, train_losses

EDGE_P = [1.0, 1.01, 1.5, 2.0, 2.5, 3.0]


def runnable_backends():
    names = []
    probe = torch.zeros(1, 1, 2, 4, device=DEVICE)
    for name in BACKENDS:
        if name == "auto":
            continue
        try:
            choose_backend(name, probe, probe, probe, p=(1.5,))
        except (ValueError, ImportError):
            continue
        names.append(name)
    return names


def assert_finite_forward_backward(q, k, v, p, **kwargs):
    if kwargs.get("backend") == "decode":
        q = q[:, :, -DECODE_MAX_QUERIES:]  # the last few queries, as when decoding against a cache
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = plap_attention(q, k, v, p, **kwargs)
    assert torch.isfinite(out).all()
    (out.float() ** 2).sum().backward()
    for name, t in zip("qkv", (q, k, v)):
        assert torch.isfinite(t.grad).all(), f"d{name} not finite"
    return out


@pytest.mark.parametrize("backend", runnable_backends())
@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("p", EDGE_P)
def test_coinciding_tokens_and_padding_rows(backend, formulation, p):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 33, 16).to(DEVICE).unbind(0)  # drawn on the CPU: the same values everywhere
    v[:, :, 5:20] = v[:, :, 4:5]  # a run of identical values (repeated words / blank patches)
    mask = torch.ones(2, 1, 1, 33, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :] = False  # a sequence that is all padding
    out = assert_finite_forward_backward(q, k, v, p, attn_mask=mask, is_causal=True, formulation=formulation,
                                         backend=backend)
    assert (out[1] == 0).all()


@pytest.mark.parametrize("backend", runnable_backends())
@pytest.mark.parametrize("scale", [1e-4, 1e3])
def test_tiny_and_large_activations(backend, scale):
    torch.manual_seed(0)
    q, k, v = (t * scale for t in torch.randn(3, 1, 2, 40, 16).to(DEVICE).unbind(0))
    for p in (1.0, 3.0):
        assert_finite_forward_backward(q, k, v, p, backend=backend)


@pytest.mark.parametrize("backend", runnable_backends())
def test_long_sequence(backend):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 1500, 16).to(DEVICE).unbind(0)
    assert_finite_forward_backward(q, k, v, [1.5, 2.5], is_causal=True, backend=backend)


# float16 autocast is a GPU precision: on the CPU autocast's own float16 support is not what anyone trains with.
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=needs_cuda)], ids=str)
@pytest.mark.parametrize("family", ["gpt2", "llama", "vision"])
def test_autocast_training_step_is_finite(monkeypatch, family, dtype):
    """One training step under autocast with plap_backend="auto", and on a GPU the fused kernels run the p != 2
    heads: a refusal there (mixed q/k/v dtypes under autocast) would fall back to a backend ~70x slower."""
    chosen = record_chosen_backends(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    if family == "vision":
        model = classifier(plap_p=[1.0, 1.5, 3.0])
        inputs = dict(pixel_values=torch.randn(2, 3, 16, 16, generator=gen), labels=torch.tensor([0, 4]))
    else:
        model = lm(**TEXT_SHAPES[family])
        inputs = dict(input_ids=torch.randint(2, 61, (2, 24), generator=gen),
                      labels=torch.randint(2, 61, (2, 24), generator=gen))  # fmt: skip
    assert model.config.plap_backend == "auto"
    model = model.train().to(DEVICE)
    inputs = {name: tensor.to(DEVICE) for name, tensor in inputs.items()}
    with torch.autocast(DEVICE.type, dtype=dtype):
        loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert len(chosen) == model.config.num_hidden_layers  # one group of p != 2 heads per layer
    assert set(chosen) == ({"triton"} if ON_CUDA else {"eager"}), chosen  # CPU: small inputs, eager (see preference)


def test_duplicate_patches_train_without_divergence():
    """A blank image (every patch identical) at the paper's p mix and a preset-like learning rate."""
    pixels = torch.zeros(4, 3, 16, 16)
    pixels[2:] = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    losses = train_losses(classifier(plap_p=[1.5, 1.5, 2.5]).to(DEVICE), 10, 1e-3, pixel_values=pixels.to(DEVICE),
                          labels=torch.tensor([0, 0, 1, 2], device=DEVICE))
    assert all(torch.isfinite(torch.tensor(losses)))
