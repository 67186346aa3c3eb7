"""Repeated and nearly repeated values against the float64 reference, in every backend.

A repeated token has exactly the value of its earlier occurrences in a first layer: D2 = 0 and P = eps^((p - 2) / 2),
the largest weight there is. The |v_x|^2 + |v_y|^2 - 2 v_x.v_y expansion rounds such a D2 to about
u (|v_x|^2 + |v_y|^2), far above eps; each backend must compute it as eq. 12 defines it (docs/numerics.md). Inputs:
exact duplicates across tile borders, a run of repeats, and near duplicates at several distances per coordinate;
p from 1 to 3 in both formulations. Relative errors ||ours - ref|| / ||ref|| as in test_backends.py.
"""

import pytest
import torch
from device import DEVICE, ON_CUDA, TRITON_HALF
from reference import reference_plap_attention
from test_backends import TORCH_BACKENDS, TRITON_MISSING, make_inputs, make_mask, relative_error, triton_small_blocks
from tiny import LLAMA_SHAPE, lm
from transformers import DataCollatorWithFlattening

from modeling_plat import plap_attention_triton as triton_module
from modeling_plat import triton_configs
from modeling_plat.plap_attention_reference import squared_value_distances

P = (1.0, 1.5, 2.5, 3.0)
U = 2.0**-24
# (B, H, Nq, Nk, d, dv); the small-block backends (16 or 24 keys a block) see the repeats in other tiles.
SHAPE = (2, 4, 40, 40, 16, 16)
# Positions of the copies of position 3's value: the same tile, the next ones, the last (partial) tile.
COPIES = (5, 17, 30, 39)
# Near duplicates (values this far apart per coordinate) are not coinciding: their distance must be resolved.
NEAR = (1e-2, 1e-3, 1e-4)


def repeated_inputs(kind, dtype, shape=SHAPE, delta=0.0, seed=0):
    """q, k, v (requiring grad) with repeated values: "copies" of one value at COPIES, a "run" of equal values
    (positions 8 to 20), or "near" copies ``delta`` apart per coordinate."""
    batch, heads, nq, nk, d, dv = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, heads, nq, d, generator=gen, dtype=torch.float64, device=DEVICE)
    k = torch.randn(batch, heads, nk, d, generator=gen, dtype=torch.float64, device=DEVICE)
    v = torch.randn(batch, heads, nk, dv, generator=gen, dtype=torch.float64, device=DEVICE)
    v = v.to(dtype).double()  # the copies below are exact in the inputs' dtype, the offsets nearly so
    if kind == "run":
        v[:, :, 8:21] = v[:, :, 8:9]
    else:
        for position in COPIES:
            if position < nk:
                sign = torch.randint(0, 2, (batch, heads, dv), generator=gen, device=DEVICE) * 2 - 1
                v[:, :, position] = v[:, :, 3] + delta * sign
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def errors(run, inputs, p=P, **kwargs):
    """Relative errors of out, dq, dk, dv against the float64 reference on the same (rounded) inputs."""
    out = run(*inputs, torch.tensor(p, device=DEVICE), **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(2), dtype=torch.float64,
                           device=DEVICE)  # fmt: skip
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference_plap_attention(*ref_inputs, torch.tensor(p, dtype=torch.float64, device=DEVICE), **kwargs)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    for ours in (out, *grads):
        assert torch.isfinite(ours).all()
    return {name: relative_error(ours, theirs)
            for name, ours, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}  # fmt: skip


def grad_bound(delta, dtype):
    """docs/numerics.md: the distance gradient of pairs delta apart per coordinate is accurate to about
    u |v| / |v_x - v_y| = u / delta for unit-sized coordinates, besides the usual float32 (half) rounding."""
    return (1e-4 if dtype == torch.float32 else 1e-2) + 16 * U / delta


BACKENDS = {**TORCH_BACKENDS, "triton": triton_small_blocks}
BACKENDS.pop("decode")  # a few queries only: test_decode below
# The Triton interpreter takes ~10 s a case: one of each pair of cases runs by default, the rest with -m slow.
SLOW = pytest.mark.slow


def cases(backend_names, *params, slow_triton):
    """pytest.params of (backend, *param) for each backend and param tuple; Triton's ``slow_triton`` ones slow."""
    return [pytest.param(name, *param, marks=SLOW if name == "triton" and param in slow_triton else ())
            for name in backend_names for param in params]  # fmt: skip


def skip_missing(backend):
    if backend == "triton" and TRITON_MISSING:
        pytest.skip("triton is not installed (pip install triton)")


@pytest.mark.parametrize(
    "backend,kind,formulation",
    cases(BACKENDS, ("copies", "paper"), ("copies", "euler"), ("run", "paper"), ("run", "euler"),
          slow_triton=[("copies", "euler"), ("run", "paper")]),
)  # fmt: skip
def test_exact_duplicates_float32(backend, kind, formulation):
    skip_missing(backend)
    inputs = repeated_inputs(kind, torch.float32)
    found = errors(BACKENDS[backend], inputs, is_causal=kind == "run", formulation=formulation)
    assert max(found.values()) <= 1e-4, found


@pytest.mark.parametrize(
    "backend,delta,formulation",
    cases(BACKENDS, *[(delta, formulation) for delta in NEAR for formulation in ("paper", "euler")],
          slow_triton=[(1e-2, "paper"), (1e-2, "euler"), (1e-3, "euler"), (1e-4, "paper")]),
)  # fmt: skip
def test_near_duplicates_float32(backend, delta, formulation):
    skip_missing(backend)
    inputs = repeated_inputs("copies", torch.float32, delta=delta)
    found = errors(BACKENDS[backend], inputs, formulation=formulation)
    assert found["out"] <= 1e-3, found
    assert max(found.values()) <= grad_bound(delta, torch.float32), found


HALF_CASES = [("tiled", torch.bfloat16), ("tiled", torch.float16), ("tiled-small-blocks", torch.bfloat16),
              ("triton", TRITON_HALF)]  # fmt: skip


@pytest.mark.parametrize(
    "backend,dtype,delta,formulation",
    [pytest.param(backend, dtype, delta, formulation,
                  marks=SLOW if backend == "triton" and (delta == 0) == (formulation == "euler") else ())
     for backend, dtype in HALF_CASES for delta in (0.0, 1e-3) for formulation in ("paper", "euler")],
)  # fmt: skip
def test_half_precision(backend, dtype, delta, formulation):
    skip_missing(backend)
    inputs = repeated_inputs("copies", dtype, delta=delta)
    found = errors(BACKENDS[backend], inputs, is_causal=True, formulation=formulation)
    assert found["out"] <= 1e-2, found
    assert max(found.values()) <= (1e-2 if delta == 0 else grad_bound(delta, dtype)), found


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("delta", [0.0, *NEAR])
def test_decode(delta, formulation):
    """A few new queries whose values repeat cached ones (positions 3 and 39 are both in the last four)."""
    inputs = repeated_inputs("copies", torch.float32, delta=delta)
    inputs[0] = inputs[0][:, :, -4:].detach().requires_grad_()
    found = errors(TORCH_BACKENDS["decode"], inputs, is_causal=True, formulation=formulation)
    assert found["out"] <= (1e-4 if delta == 0 else 1e-3), found
    assert max(found.values()) <= (1e-4 if delta == 0 else grad_bound(delta, torch.float32)), found


@pytest.mark.parametrize("formulation", ["noself", "selfweight"])
def test_study_formulations(formulation):
    inputs = repeated_inputs("copies", torch.float32)
    found = errors(TORCH_BACKENDS["eager"], inputs, is_causal=True, formulation=formulation)
    assert max(found.values()) <= 1e-4, found


def test_coinciding_pairs_are_an_exact_zero_with_no_gradient():
    """Exact duplicates: D2 = 0 exactly, so P = eps^c exactly, and no gradient flows through it."""
    (_, _, value) = repeated_inputs("copies", torch.float32)
    d2 = squared_value_distances(value, value.shape[-2])
    pairs = d2[:, :, 3, list(COPIES)]
    assert (pairs == 0).all()
    (grad,) = torch.autograd.grad(pairs.sum(), value)
    assert (grad == 0).all()
    near = repeated_inputs("copies", torch.float32, delta=1e-4)[2]
    assert (squared_value_distances(near, near.shape[-2])[:, :, 3, list(COPIES)] > 0).all()


@pytest.mark.parametrize("backend", ["eager", "tiled", "triton"])
def test_backends_agree_on_duplicates(backend):
    """Where values coincide every backend computes the same weights: outputs agree to float32 rounding."""
    skip_missing(backend)
    inputs = [t.detach() for t in repeated_inputs("run", torch.float32)]
    p = torch.tensor(P, device=DEVICE)
    expected = TORCH_BACKENDS["eager"](*inputs, p, is_causal=True)
    torch.testing.assert_close(BACKENDS[backend](*inputs, p, is_causal=True), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("is_causal", [True, False])
def test_triton_redoes_exactly_the_blocks_with_close_pairs(monkeypatch, two_passes, is_causal):
    """The forward's first pass flags the query blocks with a close pair in a tile they visit, its exact pass (over
    those blocks) the key tiles in which it met one; dQ's and dK/dV's passes split their blocks by these flags, and
    outputs and gradients match the reference either way. Copies of position 3's value at 21 and 39, blocks of 16:
    causal, the query blocks of 21 and 39 (1 and 2) pair with key 3, and the key blocks of 3 and 21 (0 and 1) with a
    later copy; without the mask every block has a close pair."""
    flags, passes = {}, []
    original = triton_module._run

    def run(launch, query, value):
        original(launch, query, value)
        passes.append((launch.kernel.__name__, bool(launch.meta["PASS"])))
        if launch.kernel.__name__ == "plap_forward_kernel":  # its flags, the last two tensor arguments
            query_blocks, key_tiles = [a for a in launch.args if isinstance(a, torch.Tensor)][-2:]
            flags["key tiles" if bool(launch.meta["PASS"]) else "query blocks"] = (key_tiles if bool(launch.meta["PASS"])
                                                                               else query_blocks).tolist()

    monkeypatch.setattr(triton_module, "_run", run)
    shape, blocks = (1, 2, 40, 40, 16, 16), 3
    batch, heads = shape[:2]
    inputs, _ = make_inputs(*shape, torch.float32)
    everything = tuple(range(blocks))
    for copies, query_blocks, key_blocks in (((), (), ()), ((21, 39), (1, 2), (0, 1))):
        with torch.no_grad():
            inputs[2][:, :, list(copies)] = inputs[2][:, :, 3:4]
        passes.clear()
        found = errors(triton_small_blocks, inputs, p=(1.5, 2.5), is_causal=is_causal)
        assert max(found.values()) <= 1e-5, found
        assert passes == [(f"plap_{kernel}_kernel", exact) for kernel in ("forward", "dq", "dkdv")
                          for _ in (1.5, 2.5) for exact in (False, True)]  # fmt: skip
        if copies and not is_causal:
            query_blocks = key_blocks = everything
        expected = {"query blocks": query_blocks, "key tiles": key_blocks}
        assert flags == {name: [int(block in flagged) for _ in range(batch * heads) for block in everything]
                         for name, flagged in expected.items()}  # fmt: skip


def _flag_test_config():
    """The launch configuration whose tiles the flag tests set: this GPU's for head size 16, or the interpreter's."""
    if ON_CUDA:
        return triton_module.launch_config(torch.float32, 16, 16, torch.cuda.get_device_capability(DEVICE))
    return triton_configs.INTERPRETER_CONFIG


def _gradients_of_one_pass(query, key, value, config, flags, exact):
    """q's, k's and v's gradients, starting as NaN, after dQ's and dK/dV's exact passes alone (``exact``) or their
    first passes alone, with ``flags`` as the forward's (its query blocks', its key tiles'); causal, the paper's two p."""
    p = [1.5, 2.5]
    out, lse, norms, *_ = triton_module._fused_forward(query, key, value, None, None, p, True, 0, 1e-6, False,
                                                       triton_module._flat(config))  # fmt: skip
    grads = [torch.full_like(t, float("nan")) for t in (query, key, value)]
    delta = torch.empty_like(lse[0])
    grad_v_own = torch.full(out.shape, float("nan"), device=DEVICE)
    for launch in triton_module.backward_launches(query, key, value, norms, None, None, torch.randn_like(out), out,
                                                  lse, delta, delta, *grads, grad_v_own, flags, p, True, 1e-6, False,
                                                  config):  # fmt: skip
        if bool(launch.meta["PASS"]) == exact:
            triton_module._run(launch, query, value)
    return grads


@pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (pip install triton)")
def test_triton_backward_passes_split_blocks_by_the_forward_flags():
    """dQ's and dK/dV's first passes leave every block the forward flagged and test none of their own; their exact
    passes leave the others. Gradients start as NaN: with every flag set the first passes write none of them, with
    none the exact passes write none; the other pass writes them all, finite."""
    query, key, value = (t.detach() for t in make_inputs(1, 2, 40, 40, 16, 16, torch.float32)[0])
    config = _flag_test_config().with_blocks(16, 16)
    for flagged in (True, False):
        for exact in (False, True):
            flags = [torch.full((count,), int(flagged), dtype=torch.int32, device=DEVICE)
                     for count in triton_module.exact_block_counts(query, key, config)]  # fmt: skip
            written = flagged == exact
            for grad in _gradients_of_one_pass(query, key, value, config, flags, exact):
                assert torch.isfinite(grad).all() if written else torch.isnan(grad).all(), (flagged, exact)


@pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("forward, backward, exact_block", [(32, 16, 0), (16, 32, 0), (16, 32, 16)],
                         ids=["forward-wider", "backward-wider", "exact-blocks-narrower"])
def test_triton_backward_blocks_follow_the_forward_flags_at_the_forward_tiles(forward, backward, exact_block):
    """The GPUs' tables give each kernel its own tiles (on sm_90 at head size 128 the forward's key tiles are 32 keys,
    dK/dV's blocks 64). With one forward query block and one forward key tile flagged, the exact passes alone write
    the gradients of exactly the dQ blocks holding a flagged query block's queries and of the dK/dV blocks holding a
    flagged key tile's keys; the first passes alone write the others. Gradients start as NaN. With exact passes on
    smaller blocks (``exact_block``) than the first passes', they write every row of the first passes' blocks that
    they leave, the rows of the exact blocks that hold no flagged row included."""
    shape = (1, 2, 70, 70, 16, 16)
    query, key, value = (t.detach() for t in make_inputs(*shape, torch.float32)[0])
    config = _flag_test_config()
    config = triton_configs.LaunchConfig(fwd=config.fwd._replace(block_m=forward, block_n=forward),
                                         dkdv=config.dkdv._replace(block_m=16, block_n=backward, exact_block=exact_block),
                                         dq=config.dq._replace(block_m=backward, block_n=16, exact_block=exact_block))  # fmt: skip
    flagged_block, slabs = 2, shape[0] * shape[1]  # the forward's query block and key tile 2 of every (batch, head)
    flags = [torch.tensor([int(block % (count // slabs) == flagged_block) for block in range(count)],
                          dtype=torch.int32, device=DEVICE)
             for count in triton_module.exact_block_counts(query, key, config)]  # fmt: skip
    expected = _rows_of_blocks_touching(shape[2], backward, forward, flagged_block)
    for exact in (False, True):
        grads = _gradients_of_one_pass(query, key, value, config, flags, exact)
        for grad in grads[:2]:  # dQ's rows are queries, dK's keys; dV has a part of each
            written = torch.isfinite(grad).all(-1)
            assert torch.isnan(grad[~written]).all()  # each row written whole or not at all
            assert written.cpu().equal((expected if exact else ~expected).expand_as(written)), (exact, written)


def _rows_of_blocks_touching(length, size, forward, flagged_block):
    """Which of ``length`` rows lie in a block of ``size`` that holds any row of the forward's block ``flagged_block``
    (of ``forward`` rows)."""
    rows = torch.arange(length)
    first, last = flagged_block * forward, min((flagged_block + 1) * forward, length) - 1
    return (rows // size >= first // size) & (rows // size <= last // size)


@pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("mask", [None, "padding"])
@pytest.mark.parametrize("p", [(1.1, 1.5), (1.5, 2.5)])
def test_triton_exact_pass_alone_equals_both_passes(monkeypatch, mask, formulation, p):
    """Calls up to ONE_PASS_PAIRS run each kernel's exact pass alone over every block, larger ones a first pass and
    the exact pass of the flagged blocks: in float32 the same outputs and gradients to the bit, with blocks of both
    kinds (copies of position 3's value at 21 and 39, blocks of 16, causal). (With bfloat16 values the exact pass
    splits Gd in three parts where a first pass rounds it to bfloat16.) The paper's two p are one launch of the exact
    pass alone, whose square-root chain for p = 2.5 rounds otherwise (sqrt(rsqrt(x) x), 1 / x as rsqrt(x)^2) than its
    own launches' (sqrt(sqrt(x)), rcp(x)): within float32's rounding of each tensor's scale there."""
    shape = (2, 2, 40, 40, 16, 16)
    inputs, _ = make_inputs(*shape, torch.float32)
    with torch.no_grad():
        inputs[2][:, :, [21, 39]] = inputs[2][:, :, 3:4]
    grad_out = torch.randn(shape[:3] + shape[-1:], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    attn_mask = make_mask(mask, *shape[:4])
    original, results = triton_module._run, {}
    for limit in (0, 2**62):
        passes = []
        monkeypatch.setattr(triton_module, "ONE_PASS_PAIRS", limit)
        monkeypatch.setattr(triton_module, "_run", lambda launch, query, value: (passes.append(bool(launch.meta["PASS"])),
                                                                                 original(launch, query, value)))
        out = triton_small_blocks(*inputs, torch.tensor(p), attn_mask=attn_mask, is_causal=True,
                                  formulation=formulation)  # fmt: skip
        results[tuple(passes)] = (out, *torch.autograd.grad(out, inputs, grad_out))
    merged = p == (1.5, 2.5)
    # each pass once, of each p where the chains are a launch each; alone, both p at once
    assert set(results) == {(False, True) * (6 if merged else 3), (True,) * 3}
    for after_first, alone in zip(*results.values()):  # limit 0 first: two passes
        if merged:
            torch.testing.assert_close(alone, after_first, rtol=1e-5, atol=1e-5 * float(after_first.detach().abs().max()))
        else:
            assert torch.equal(alone, after_first)


# Text with repeated tokens: a few words, each several times, in a Llama-shaped model whose first layer gives
# every occurrence of a word the same value.
WORDS = 7


def repeated_ids(length, seed):
    return torch.randint(2, 2 + WORDS, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("backend", ["eager", "tiled", "triton"])
def test_llama_shaped_model_matches_its_float64_self(backend, formulation):
    """Its float64 self runs eager (the kernels take no float64); lm() seeds the same weights."""
    skip_missing(backend)
    settings = dict(LLAMA_SHAPE, plap_p=[1.0, 1.5, 2.5, 3.0], plap_formulation=formulation)
    ids = torch.tensor([repeated_ids(40, seed) for seed in range(2)], device=DEVICE)
    with torch.no_grad():
        logits = lm(**settings, plap_backend=backend).to(DEVICE)(ids).logits
        expected = lm(**settings, plap_backend="eager").to(DEVICE, torch.float64)(ids).logits
    assert relative_error(logits, expected) <= 1e-4


@pytest.mark.parametrize("formulation", ["paper", "euler"])
@pytest.mark.parametrize("backend", ["eager", "tiled", "triton"])
def test_packed_rows_match_each_document_alone(backend, formulation):
    """A packed row holds other documents in the same tiles, so the expansion's rounding (and any rule on it)
    sees other norms and other accumulation orders than each document alone."""
    skip_missing(backend)
    model = lm(**LLAMA_SHAPE, plap_p=[1.0, 1.5, 2.5, 3.0], plap_formulation=formulation, plap_backend=backend)
    model.to(DEVICE)
    documents = [repeated_ids(length, seed) for seed, length in enumerate((13, 30, 21))]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": document} for document in documents])
    with torch.no_grad():
        packed = model(batch["input_ids"].to(DEVICE), position_ids=batch["position_ids"].to(DEVICE)).logits
        start = 0
        for document in documents:
            alone = model(torch.tensor([document], device=DEVICE)).logits
            assert relative_error(packed[:, start : start + len(document)], alone) <= 1e-5
            start += len(document)
