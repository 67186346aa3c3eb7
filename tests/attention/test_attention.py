"""The eager p-Laplacian attention against the independent float64 reference of eq. 12 (tests/reference.py), on the
tests' device (tests/device.py)."""

import pytest
import torch
import torch.nn.functional as F

from device import DEVICE
from modeling_plat import FORMULATIONS, plap_attention, plap_attention_weights
from reference import reference_plap_attention

P_VALUES = [1.1, 1.5, 2.0, 2.5, 3.0]


def make_inputs(batch=2, heads=5, nq=7, nk=7, d=6, dv=6, dtype=torch.float64, duplicates=False, seed=0,
                device=DEVICE):  # fmt: skip
    """[q, k, v] requiring grad on ``device``, drawn on the CPU: the same values on every device."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, nq, d, generator=gen, dtype=dtype)
    k = torch.randn(batch, heads, nk, d, generator=gen, dtype=dtype)
    v = torch.randn(batch, heads, nk, dv, generator=gen, dtype=dtype)
    if duplicates:
        v[:, :, 1] = v[:, :, 0]  # two tokens with identical values: zero distance off the diagonal
        v[:, :, -1] = v[:, :, 0]
        k[:, :, -1] = k[:, :, 0]
    return [t.to(device).requires_grad_() for t in (q, k, v)]


def padding_mask(batch, nq, nk, device=DEVICE):
    keep = torch.ones(batch, nk, dtype=torch.bool, device=device)
    keep[0, :2] = False  # left padding in the first sequence
    keep[-1, -1] = False  # right padding in the last
    return keep[:, None, None, :].expand(batch, 1, nq, nk)


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def check_against_reference(inputs, p, tol, **kwargs):
    q, k, v = inputs
    ours = plap_attention(q, k, v, p, **kwargs)
    ref = reference_plap_attention(q, k, v, p, **kwargs)
    assert ours.dtype == q.dtype and ours.shape == ref.shape
    assert relative_error(ours, ref) <= tol
    grad_out = torch.randn_like(ref)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad_out.to(ours.dtype))
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for name, g_ours, g_ref in zip("qkv", ours_grads, ref_grads):
        assert torch.isfinite(g_ours).all(), f"non-finite d{name}"
        assert relative_error(g_ours, g_ref) <= tol, f"d{name} differs"


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("duplicates", [False, True])
def test_matches_reference_float64(formulation, is_causal, masked, duplicates):
    inputs = make_inputs(duplicates=duplicates)
    p = torch.tensor(P_VALUES, dtype=torch.float64, device=DEVICE)  # one head per p value
    mask = padding_mask(2, 7, 7) if masked else None
    check_against_reference(inputs, p, 1e-8, attn_mask=mask, is_causal=is_causal, formulation=formulation)


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("p", P_VALUES)
def test_matches_reference_float32_single_p(formulation, p):
    inputs = make_inputs(heads=2, nq=9, nk=9, d=8, dv=8, dtype=torch.float32)
    check_against_reference(inputs, p, 1e-4, is_causal=True, formulation=formulation)


@pytest.mark.parametrize("formulation", ["paper", "euler"])
def test_cache_alignment_fewer_queries_than_keys(formulation):
    """With a KV cache, query i is the token at key position Nk - Nq + i (bottom-right alignment)."""
    inputs = make_inputs(nq=3, nk=8)
    p = torch.tensor(P_VALUES, dtype=torch.float64, device=DEVICE)
    check_against_reference(inputs, p, 1e-8, is_causal=True, formulation=formulation)
    # ... and equals the last rows of the full computation
    q_full, k, v = make_inputs(nq=8, nk=8)
    full = plap_attention(q_full, k, v, p, is_causal=True, formulation=formulation)
    last = plap_attention(q_full[:, :, -3:], k, v, p, is_causal=True, formulation=formulation)
    torch.testing.assert_close(last, full[:, :, -3:])


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_p2_is_softmax_attention(is_causal, formulation):
    q, k, v = (t.detach().float() for t in make_inputs(nq=11, nk=11, d=16, dv=16))
    mask = padding_mask(2, 11, 11)
    for m in (None, mask):
        ours = plap_attention(q, k, v, 2.0, attn_mask=m, is_causal=is_causal, formulation=formulation)
        if m is not None and is_causal:
            m = m & torch.ones(11, 11, dtype=torch.bool, device=DEVICE).tril()
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        else:
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=is_causal)
        torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("formulation", ["paper", "euler"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(formulation):
    q, k, v = make_inputs(dtype=torch.float32)
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool, device=DEVICE)
    mask[0, :, 3] = False  # query 3 of the first sequence may attend to nothing
    mask[1] = False  # the whole second sequence is padding
    out = plap_attention(q, k, v, [1.5, 1.5, 2.0, 2.5, 3.0], attn_mask=mask, formulation=formulation)
    assert torch.isfinite(out).all()
    assert (out[0, :, 3] == 0).all() and (out[1] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_p_in_float32(dtype):
    q, k, v = (t.detach() for t in make_inputs(dtype=torch.float32, duplicates=True))
    ours = plap_attention(q.to(dtype), k.to(dtype), v.to(dtype), 1.5)
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    ref = reference_plap_attention(q.to(dtype), k.to(dtype), v.to(dtype), 1.5)
    assert relative_error(ours, ref) <= 2e-2


def test_duplicate_tokens_float32_stay_finite():
    """Coinciding values (zero distance off the diagonal) must not produce inf or NaN, forward or backward."""
    q, k, v = make_inputs(dtype=torch.float32)
    with torch.no_grad():
        v[:, :, :] = v[:, :, :1]  # every token has the same value
    out = plap_attention(q, k, v, [1.0, 1.1, 1.5, 2.5, 3.0], is_causal=True)
    out.square().sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_paper_diagonal_weight_is_eps_power():
    """p < 2: the token's own weight is A[x, x] * eps ** ((p - 2) / 2), eq. 12 taken literally."""
    q, k, v = (t.detach() for t in make_inputs(heads=1))
    weights = plap_attention_weights(q, k, v, torch.tensor([1.5], device=DEVICE), eps=1e-6)
    attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    torch.testing.assert_close(weights.diagonal(dim1=-2, dim2=-1), attn.diagonal(dim1=-2, dim2=-1) * 1e-6**-0.25)


def test_the_factorial_splits_eq_12_into_self_weight_and_p_weighting():
    """noself is eq. 12 with the self pair's P = 1; selfweight is softmax with eq. 12's self pair alone."""
    q, k, v = (t.detach() for t in make_inputs())
    p = torch.tensor(P_VALUES, dtype=torch.float64, device=DEVICE)
    weights = {name: plap_attention_weights(q, k, v, p, formulation=name) for name in ("paper", "noself", "selfweight")}
    attn = plap_attention_weights(q, k, v, torch.full_like(p, 2.0))  # softmax
    own = torch.eye(7, dtype=torch.bool, device=DEVICE)
    torch.testing.assert_close(weights["noself"][..., own], attn[..., own])
    torch.testing.assert_close(weights["noself"][..., ~own], weights["paper"][..., ~own])
    torch.testing.assert_close(weights["selfweight"][..., own], weights["paper"][..., own])
    torch.testing.assert_close(weights["selfweight"][..., ~own], attn[..., ~own])


def test_euler_weights_rows_sum_to_one():
    q, k, v = (t.detach() for t in make_inputs())
    p = torch.tensor(P_VALUES, dtype=torch.float64, device=DEVICE)
    weights = plap_attention_weights(q, k, v, p, formulation="euler")
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1], dtype=weights.dtype, device=DEVICE))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(p=[1.5, 2.5]), "one value per head"),
        (dict(p=0.5), ">= 1"),
        (dict(p=float("inf")), "finite"),
        (dict(p=[1.5, float("nan"), 1.5, 2.5, 2.5]), "finite"),
        (dict(eps=0.0), "eps"),
        (dict(formulation="implicit"), "formulation"),
        (dict(backend="cuda-magic"), "backend"),
        (dict(attn_mask=(3, 3), mask_dtype=torch.bool), "broadcast"),
        (dict(attn_mask=(7, 7), mask_dtype=torch.float32), "boolean"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    q, k, v = make_inputs()
    args = dict(p=1.5) | kwargs
    if "attn_mask" in args:  # built here, on the tests' device
        args["attn_mask"] = torch.ones(args["attn_mask"], dtype=args.pop("mask_dtype"), device=DEVICE)
    for _ in range(2):  # and again: what is checked once per value (p) is not skipped for a bad one
        with pytest.raises(ValueError, match=message):
            plap_attention(q, k, v, **args)


def test_bad_shapes_raise_clear_errors():
    q, k, v = make_inputs(nq=7, nk=5)
    with pytest.raises(ValueError, match="queries cannot be more"):
        plap_attention(q, k, v, 1.5)
    with pytest.raises(ValueError, match="4-D"):
        plap_attention(q[0], k[0], v[0], 1.5)
