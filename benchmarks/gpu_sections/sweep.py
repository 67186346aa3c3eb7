"""The sweep section: every backend against the float64 eager reference on the same GPU, case by case, in spawned
worker processes so that a crashed kernel cannot take the check along."""

import contextlib
import functools
import importlib
import itertools
import traceback

import torch

from modeling_plat.plap_dispatch import choose_backend, plap_attention

from .measure import TOLERANCE, relative_error
from .spawned import outcomes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DIMS = (16, 48, 64, 80, 128)
FEW_HEAD_DIMS = (16, 64, 128)
# The window cases' size: shorter than their keys, not a multiple of any tile.
WINDOW = 50
# float32 matmuls with inputs rounded to TF32 (2^-11 relative): 1.2e-4 to 7.1e-4 measured on an H100.
TF32_TOLERANCE = 2e-3
# (B, H, Nq, Nk) of the sweep: lengths that are not multiples of any tile.
SQUARE, KV_CACHE = (2, 3, 200, 200), (2, 3, 77, 200)
P_PER_HEAD = (1.5, 2.5, 3.0)
# Positions whose values copy position 4's: a run inside the first tile, single copies in later ones.
REPEATS = (*range(5, 20), 70, 150, 199)
# Document lengths of the two packed rows of SQUARE: no tile multiples, a one-token document, a long one.
PACKED_LENGTHS = ((37, 1, 100, 62), (64, 64, 72))
CONVERSIONS = ("gpt2", "llama", "vit")


def sweep_cases():
    """Every case of the correctness sweep, as JSON-ready dicts: its groups interleaved, a case of each in turn, so that
    a sweep that the time budget cuts short has checked some of every group."""
    return interleaved([_backend_cases(), _two_pass_cases(), _envelope_cases(), _repeated_and_packed_cases(),
                        _tf32_cases(), _conversion_cases()])  # fmt: skip


def interleaved(groups):
    """The cases of ``groups`` (lists), one of each in turn while it has any: each group's in its own order."""
    return [case for cases in itertools.zip_longest(*groups) for case in cases if case is not None]


def _backend_cases():
    # Dtype and head size vary fastest: side by side, the workers build different kernels.
    return [dict(kind="backend", backend=backend, dtype=dtype, head_dim=head_dim, formulation=formulation,
                 masked=masked, shape=shape)
            for backend, shape, masked, formulation, head_dim, dtype in itertools.product(
                ("triton", "auto"), (SQUARE, KV_CACHE), (False, True), ("paper", "euler"), HEAD_DIMS, DTYPES)]  # fmt: skip


def _two_pass_cases():
    # The sweep's small calls run each kernel's exact pass alone (ONE_PASS_PAIRS); large ones a first pass, then the
    # exact pass of the flagged blocks: the same cases with both passes, the power's three classes among the heads.
    return [dict(case, two_passes=True) for case in _backend_cases() if case["backend"] == "triton"]


def _envelope_cases():
    """What the kernels took in last: a causal sliding window with key padding, and head sizes of the largest bucket
    (160 pads to 256), with repeated values there too; Triton's also with both passes."""
    cases = []
    for backend, formulation, dtype in itertools.product(("triton", "auto"), ("paper", "euler"), DTYPES):
        cases += [dict(kind="window", backend=backend, dtype=dtype, head_dim=head_dim, formulation=formulation,
                       masked=True, shape=SQUARE, window=WINDOW) for head_dim in FEW_HEAD_DIMS]  # fmt: skip
        cases += [dict(kind=kind, backend=backend, dtype=dtype, head_dim=head_dim, formulation=formulation,
                       masked=True, shape=SQUARE)
                  for kind, head_dim in (("backend", 160), ("backend", 256), ("repeated", 256))]  # fmt: skip
    return cases + [dict(case, two_passes=True) for case in cases if case["backend"] == "triton"]


def _repeated_and_packed_cases():
    # masked: causal + key padding for repeated values; causal for packed rows (their documents are the mask).
    cases = []
    for kind, backend, masked, formulation, head_dim, dtype in itertools.product(
        ("repeated", "packed"), ("triton", "auto"), (False, True), ("paper", "euler"), FEW_HEAD_DIMS, DTYPES
    ):
        cases.append(dict(kind=kind, backend=backend, dtype=dtype, head_dim=head_dim, formulation=formulation,
                          masked=masked, shape=SQUARE))  # fmt: skip
        if backend == "triton":
            cases.append(dict(cases[-1], two_passes=True))
    return cases


def _tf32_cases():
    return [dict(kind="tf32", backend=backend, dtype="float32", head_dim=64, formulation=formulation, masked=True,
                 shape=SQUARE) for backend, formulation in itertools.product(("eager", "tiled"), ("paper", "euler"))]


def _conversion_cases():
    return [dict(kind="convert", model=model, dtype=dtype)
            for model, dtype in itertools.product(CONVERSIONS, ("float32", "bfloat16"))]


def case_name(case):
    if case["kind"] == "convert":
        return f"convert/{case['model']}/{case['dtype']}"
    batch, heads, nq, nk = case["shape"]
    mask = ("causal" if case["kind"] == "packed" else "causal+padding") if case["masked"] else "nomask"
    mask += f"+window{case['window']}" if "window" in case else ""
    passes = "/two-passes" if case.get("two_passes") else ""
    return (f"{case['kind']}/{case['backend']}/{case['dtype']}/d{case['head_dim']}/{case['formulation']}/{mask}/"
            f"nq{nq}-nk{nk}{passes}")  # fmt: skip


def document_ids(device):
    return torch.tensor([[doc for doc, n in enumerate(row) for _ in range(n)] for row in PACKED_LENGTHS], device=device)


def make_case_inputs(case, device):
    """(q, k, v) leaves in the case's dtype, p, the mask arguments and the output gradient."""
    batch, heads, nq, nk = case["shape"]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, nq, case["head_dim"], generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, nk, case["head_dim"], generator=gen, dtype=torch.float64) for _ in range(2))
    if case["kind"] in ("tf32", "repeated"):
        # Repeated tokens: exact duplicates in any dtype, D2 = 0 off the diagonal.
        v[:, :, [position for position in REPEATS if position < nk]] = v[:, :, 4:5]
    dtype = DTYPES[case["dtype"]]
    inputs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    p = tuple(P_PER_HEAD[h % len(P_PER_HEAD)] for h in range(heads))  # static, as models pass it: no host read
    kwargs = dict(formulation=case["formulation"])
    if case["kind"] == "packed":
        kwargs.update(is_causal=case["masked"], document_ids=document_ids(device))
    elif case["masked"]:
        keep = torch.ones(batch, nk, dtype=torch.bool)
        keep[0, :7] = False  # left padding
        keep[-1, :] = False  # a sequence with every key masked
        kwargs.update(is_causal=True, attn_mask=keep[:, None, None, :].to(device))
        if "window" in case:
            kwargs["sliding_window"] = case["window"]
    grad_out = torch.randn(batch, heads, nq, case["head_dim"], generator=gen, dtype=torch.float64).to(device)
    return inputs, p, kwargs, grad_out


def attend(inputs, p, kwargs, backend):
    return plap_attention(*inputs, p, **kwargs, backend=backend)


def each_document_alone(inputs, p, kwargs, backend):
    """What packed rows must give: every document attended alone, without document_ids, put back in place."""
    alone = {name: value for name, value in kwargs.items() if name != "document_ids"}
    rows = []
    for row, lengths in enumerate(PACKED_LENGTHS):
        starts = itertools.accumulate(lengths, initial=0)
        rows.append(torch.cat([attend([t[row : row + 1, :, start : start + n] for t in inputs], p, alone, backend)
                               for start, n in zip(starts, lengths)], dim=2))  # fmt: skip
    return torch.cat(rows)


def outputs_and_gradients(inputs, p, kwargs, grad_out, backend, run=attend):
    out = run(inputs, p, kwargs, backend)
    return (out, *torch.autograd.grad(out, inputs, grad_out.to(out.dtype)))


def conversion_models(name):
    """A tiny random transformers model of a CONVERSIONS name, its p = 2 conversion and example inputs."""
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ViTConfig,
                              ViTForImageClassification)  # fmt: skip

    from modeling_plat.convert import convert_to_plat

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "vit":
        source = ViTForImageClassification(ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=128, image_size=32, patch_size=4,
                                                     num_labels=10))  # fmt: skip
        inputs = dict(pixel_values=torch.randn(2, 3, 32, 32, generator=gen))
    else:
        if name == "gpt2":
            source = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64,
                                                bos_token_id=0, eos_token_id=0))  # fmt: skip
        else:
            source = LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=64))  # fmt: skip
        inputs = dict(input_ids=torch.randint(0, 101, (2, 48), generator=gen))
    return source.eval(), convert_to_plat(source, plap_p=2.0).eval(), inputs


def run_conversion(case, device):
    source, plat, inputs = conversion_models(case["model"])
    dtype = DTYPES[case["dtype"]]
    source, plat = source.to(device, dtype), plat.to(device, dtype)
    inputs = {name: t.to(device, dtype) if t.is_floating_point() else t.to(device) for name, t in inputs.items()}
    with torch.no_grad():
        expected = source(**inputs).logits
        first, second = (plat(**inputs).logits for _ in range(2))
    return dict(status="ok", errors=dict(logits=relative_error(first, expected)),
                max_abs_diff=(first.double() - expected.double()).abs().max().item(),
                max_abs_logit=expected.abs().max().item(), finite=bool(torch.isfinite(first).all()),
                bitwise_rerun=torch.equal(first, second))  # fmt: skip


@contextlib.contextmanager
def one_pass_pairs(limit):
    """The Triton backend's ONE_PASS_PAIRS set to ``limit`` (None: left as it is)."""
    triton_module = importlib.import_module("modeling_plat.plap_attention_triton")
    original = triton_module.ONE_PASS_PAIRS
    triton_module.ONE_PASS_PAIRS = original if limit is None else limit
    try:
        yield
    finally:
        triton_module.ONE_PASS_PAIRS = original


def run_case(case, device):
    """Result of one sweep case: the backend that ran, relative errors and the rerun check, or a skip."""
    device = torch.device(device)
    if case["kind"] == "convert":
        return run_conversion(case, device)
    inputs, p, kwargs, grad_out = make_case_inputs(case, device)
    try:
        backend = choose_backend(case["backend"], *inputs, p=p, attn_mask=kwargs.get("attn_mask"),
                                 is_causal=kwargs.get("is_causal", False), sliding_window=kwargs.get("sliding_window"),
                                 document_ids=kwargs.get("document_ids"), formulation=case["formulation"]).name
    except ValueError as reason:
        return dict(status="skipped", reason=str(reason))
    reference_inputs = [t.detach().double().requires_grad_() for t in inputs]
    reference_run = each_document_alone if case["kind"] == "packed" else attend
    reference = outputs_and_gradients(reference_inputs, p, kwargs, grad_out, "eager", reference_run)

    def errors(results):
        return {name: relative_error(ours, ref)
                for name, ours, ref in zip(("out", "dq", "dk", "dv"), results, reference)}

    with tf32_matmuls(case["kind"] == "tf32"), one_pass_pairs(0 if case.get("two_passes") else None):
        first = outputs_and_gradients(inputs, p, kwargs, grad_out, case["backend"])
        second = outputs_and_gradients(inputs, p, kwargs, grad_out, case["backend"])
    result = dict(status="ok", backend=backend, errors=errors(first),
                  finite=all(bool(torch.isfinite(t).all()) for t in first),
                  bitwise_rerun=all(torch.equal(a, b) for a, b in zip(first, second)))  # fmt: skip
    if case["kind"] == "tf32":
        result["errors_without_tf32"] = errors(outputs_and_gradients(inputs, p, kwargs, grad_out, case["backend"]))
    return result


@contextlib.contextmanager
def tf32_matmuls(enabled):
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def judge(case, result):
    """The list of reasons this case failed (empty if it passed)."""
    if result["status"] == "error":
        return [result["error"]]
    if result["status"] == "skipped":
        return []
    problems = []
    for name, error in result["errors"].items():
        floor = TF32_TOLERANCE if case["kind"] == "tf32" else TOLERANCE[case["dtype"]]
        limit = max(floor, 2 * result.get("errors_without_tf32", {}).get(name, 0))
        if not error <= limit:
            problems.append(f"{name} error {error:.2e} > {limit:.1e}")
    if not result["finite"]:
        problems.append("non-finite values")
    if not result["bitwise_rerun"]:
        problems.append("a second run differs")
    return problems


def run_sweep(cases, runner, log=print, workers=0, seconds=None):
    """Run every case with runner(case) -> result dict, with ``workers`` in that many spawned processes (``outcomes``):
    an exception becomes an "error" result, a case whose result is not in within ``seconds`` (None: no limit) is
    "skipped" for the time budget, and not waited for."""
    results = []
    for case, outcome in outcomes(cases, runner, workers, seconds):
        if isinstance(outcome, TimeoutError):
            result = dict(status="skipped", reason="the time budget ran out before its result")
        elif isinstance(outcome, Exception):  # a crash is a failed check, reported with the rest
            result = dict(status="error", error=f"{type(outcome).__name__}: {outcome}",
                          trace="".join(traceback.format_exception(outcome)))  # fmt: skip
        else:
            result = outcome
        result.update(case=case_name(case), failures=judge(case, result))
        log(f"{result['case']:<60} {result['status']:<8} {result.get('backend', '')} "
            f"{'; '.join(result['failures'])}")  # fmt: skip
        results.append(result)
    return results


def sweep_section(device, log, workers=0, cases=None, seconds=None):
    return run_sweep(sweep_cases() if cases is None else cases, functools.partial(run_case, device=str(device)),
                     log, workers, seconds)  # fmt: skip
