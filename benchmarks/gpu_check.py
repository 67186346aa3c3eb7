"""Check the p-Laplacian attention backends on a CUDA GPU and time them against SDPA's flash attention.

    python benchmarks/gpu_check.py --out results/gpu_check

1. Correctness sweep: float32 / bfloat16 / float16 x head sizes 16, 48, 64, 80, 128 x paper / euler x
   (no mask, causal + key padding) x (Nq = Nk, Nq < Nk), through ``backend="auto"`` and, where it admits the
   input, ``backend="triton"``: the output and the gradients of q, k and v against the float64 eager
   reference on the same GPU (relative errors, the tolerances of tests/attention/test_backends.py), and a second run
   that must be bitwise identical. Then the eager and tiled backends in float32 on values with exact
   duplicates (repeated tokens), where the distance expansion cancels, with TF32 matmuls on
   (torch.backends.cuda.matmul.allow_tf32): their errors must stay within twice those with TF32 off.
2. Attention benchmark in bfloat16, the Triton backend against SDPA restricted to its flash backend, forward
   and forward + backward, at N = 1k / 4k / 16k (d = 64, B * H = 32, causal), the paper's LM shape and
   DeiT-tiny. Throughput is reported against each algorithm's matmul floor (multiply-adds of its matmuls,
   x2 flops): p-LaT 3 N^2 d forward (QK^T, VV^T, AV) and 11 N^2 d forward + backward; softmax attention 2
   and 7. Causal shapes count half.
3. Training step in bfloat16 autocast (forward, backward, AdamW) of the p-LaT DeiT-tiny and paper LM (see
   benchmarks/bench_train_step.py) against their softmax baselines with SDPA flash attention.

Everything goes to DIR/gpu_check.json with the GPU name, compute capability, driver, CUDA, torch and Triton
versions. The exit status is 1 if any check failed (a tolerance, a rerun that differs, an error), 2 without
a CUDA GPU.
"""

import argparse
import contextlib
import itertools
import json
import platform
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from modeling_plat.plap_attention import choose_backend, plap_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DIMS = (16, 48, 64, 80, 128)
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
# (B, H, Nq, Nk) of the sweep: lengths that are not multiples of any tile.
SQUARE, KV_CACHE = (2, 3, 200, 200), (2, 3, 77, 200)
P_PER_HEAD = (1.5, 2.5, 3.0)
# name: (batch, heads, length, head size, causal)
ATTENTION_SHAPES = {
    "long-1k": (4, 8, 1024, 64, True),
    "long-4k": (4, 8, 4096, 64, True),
    "long-16k": (4, 8, 16384, 64, True),
    "paper-lm": (16, 8, 256, 16, True),
    "deit-tiny": (32, 3, 197, 64, False),
}
# Multiply-adds of the matmuls per score and head-size unit: forward, forward + backward.
MATMUL_FLOOR = {"plap": (3, 11), "sdpa": (2, 7)}


def sweep_cases():
    """Every case of the correctness sweep, as JSON-ready dicts."""
    cases = []
    for dtype, head_dim, formulation, masked, shape in itertools.product(
        DTYPES, HEAD_DIMS, ("paper", "euler"), (False, True), (SQUARE, KV_CACHE)
    ):
        for backend in ("auto", "triton"):
            cases.append(dict(kind="backend", backend=backend, dtype=dtype, head_dim=head_dim,
                              formulation=formulation, masked=masked, shape=shape))  # fmt: skip
    for backend, formulation in itertools.product(("eager", "tiled"), ("paper", "euler")):
        cases.append(dict(kind="tf32", backend=backend, dtype="float32", head_dim=64, formulation=formulation,
                          masked=True, shape=SQUARE))  # fmt: skip
    return cases


def case_name(case):
    batch, heads, nq, nk = case["shape"]
    mask = "causal+padding" if case["masked"] else "nomask"
    return (f"{case['kind']}/{case['backend']}/{case['dtype']}/d{case['head_dim']}/{case['formulation']}/{mask}/"
            f"nq{nq}-nk{nk}")  # fmt: skip


def make_case_inputs(case, device):
    """(q, k, v) leaves in the case's dtype, p, the mask arguments and the output gradient."""
    batch, heads, nq, nk = case["shape"]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, nq, case["head_dim"], generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, nk, case["head_dim"], generator=gen, dtype=torch.float64) for _ in range(2))
    if case["kind"] == "tf32":
        v[:, :, 5:20] = v[:, :, 4:5]  # repeated tokens: exact duplicates, D2 = 0 off the diagonal
    dtype = DTYPES[case["dtype"]]
    inputs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    p = tuple(P_PER_HEAD[h % len(P_PER_HEAD)] for h in range(heads))  # static, as models pass it: no host read
    kwargs = dict(formulation=case["formulation"])
    if case["masked"]:
        keep = torch.ones(batch, nk, dtype=torch.bool)
        keep[0, :7] = False  # left padding
        keep[-1, :] = False  # a sequence with every key masked
        kwargs.update(is_causal=True, attn_mask=keep[:, None, None, :].to(device))
    grad_out = torch.randn(batch, heads, nq, case["head_dim"], generator=gen, dtype=torch.float64).to(device)
    return inputs, p, kwargs, grad_out


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def outputs_and_gradients(inputs, p, kwargs, grad_out, backend):
    out = plap_attention(*inputs, p, **kwargs, backend=backend)
    return (out, *torch.autograd.grad(out, inputs, grad_out.to(out.dtype)))


def run_case(case, device):
    """Result of one sweep case: the backend that ran, relative errors and the rerun check, or a skip."""
    inputs, p, kwargs, grad_out = make_case_inputs(case, device)
    try:
        backend = choose_backend(case["backend"], *inputs, p=p, attn_mask=kwargs.get("attn_mask")).name
    except ValueError as reason:
        return dict(status="skipped", reason=str(reason))
    reference_inputs = [t.detach().double().requires_grad_() for t in inputs]
    reference = outputs_and_gradients(reference_inputs, p, kwargs, grad_out, "eager")

    def errors(results):
        return {name: relative_error(ours, ref)
                for name, ours, ref in zip(("out", "dq", "dk", "dv"), results, reference)}

    with tf32_matmuls(case["kind"] == "tf32"):
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
        # Under TF32 the float32 backends must do as well as without it (duplicates cost float32 accuracy).
        limit = max(TOLERANCE[case["dtype"]], 2 * result.get("errors_without_tf32", {}).get(name, 0))
        if not error <= limit:
            problems.append(f"{name} error {error:.2e} > {limit:.1e}")
    if not result["finite"]:
        problems.append("non-finite values")
    if not result["bitwise_rerun"]:
        problems.append("a second run differs")
    return problems


def run_sweep(cases, runner, log=print):
    """Run every case with runner(case) -> result dict; an exception becomes an "error" result."""
    results = []
    for case in cases:
        try:
            result = runner(case)
        except Exception as error:  # a crash is a failed check, reported with the rest
            result = dict(status="error", error=f"{type(error).__name__}: {error}", trace=traceback.format_exc())
        result.update(case=case_name(case), failures=judge(case, result))
        log(f"{result['case']:<60} {result['status']:<8} {result.get('backend', '')} {'; '.join(result['failures'])}")
        results.append(result)
    return results


def timed(fn, warmup, repeats):
    """Median seconds of fn() on the GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def attention_benchmark(name, device, warmup, repeats):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads, length, head_dim, causal = ATTENTION_SHAPES[name]
    q, k, v = (torch.randn(batch, heads, length, head_dim, device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    grad_out = torch.randn_like(q)
    p = tuple(P_PER_HEAD[h % len(P_PER_HEAD)] for h in range(heads))  # static, as models pass it: no host read

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def plap():
        return plap_attention(q, k, v, p, is_causal=causal, backend="triton")

    scores = batch * heads * length * length * (0.5 if causal else 1.0)
    row = dict(shape=name, batch=batch, heads=heads, length=length, head_dim=head_dim, causal=causal)
    for label, fn in (("sdpa", sdpa), ("plap", plap)):
        with torch.no_grad():
            forward = timed(fn, warmup, repeats)
        both = timed(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), grad_out), warmup, repeats)
        floor_fwd, floor_both = MATMUL_FLOOR[label]
        row[label] = dict(fwd_ms=forward * 1e3, fwd_bwd_ms=both * 1e3,
                          fwd_tflops=2 * floor_fwd * scores * head_dim / forward / 1e12,
                          fwd_bwd_tflops=2 * floor_both * scores * head_dim / both / 1e12)  # fmt: skip
    row["fwd_ratio"] = row["plap"]["fwd_ms"] / row["sdpa"]["fwd_ms"]
    row["fwd_bwd_ratio"] = row["plap"]["fwd_bwd_ms"] / row["sdpa"]["fwd_bwd_ms"]
    return row


def train_step_benchmark(pair, device, warmup, repeats):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench_train_step import batches, lm_models, vision_models

    models = vision_models("triton") if pair == "vision" else lm_models("triton")
    inputs = {key: value.to(device) for key, value in batches(pair, 32 if pair == "vision" else 16).items()}
    rows = {}
    for name, model in models.items():
        model.to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer):
            with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                model(**inputs).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        rows[name] = dict(pair=pair, step_ms=timed(step, warmup, repeats) * 1e3)
        model.cpu()
    baseline = rows[list(rows)[-1]]["step_ms"]
    for row in rows.values():
        row["ratio_to_softmax"] = row["step_ms"] / baseline
    return rows


def environment(device):
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        driver = "unknown (nvidia-smi failed)"
    major, minor = torch.cuda.get_device_capability(device)
    return dict(gpu=torch.cuda.get_device_name(device), capability=f"{major}.{minor}", driver=driver,
                cuda=torch.version.cuda, torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version())  # fmt: skip


def write_report(out_dir, report):
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2))
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json")
    parser.add_argument("--skip-benchmarks", action="store_true", help="the correctness sweep only")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU and torch.cuda.is_available() is False here; on CPU the kernels "
              "are checked by the test suite (pytest) instead.", file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device("cuda")
    report = dict(environment=environment(device))
    print(json.dumps(report["environment"]))
    report["sweep"] = run_sweep(sweep_cases(), lambda case: run_case(case, device))
    failures = [f"{r['case']}: {'; '.join(r['failures'])}" for r in report["sweep"] if r["failures"]]
    if not args.skip_benchmarks:
        report["attention"] = []
        for name in ATTENTION_SHAPES:
            try:
                report["attention"].append(attention_benchmark(name, device, args.warmup, args.repeats))
            except Exception as error:
                failures.append(f"attention benchmark {name}: {type(error).__name__}: {error}")
            print(json.dumps(report["attention"][-1:]))
        report["train_step"] = {}
        for pair in ("vision", "lm"):
            try:
                report["train_step"].update(train_step_benchmark(pair, device, args.warmup, args.repeats))
            except Exception as error:
                failures.append(f"train-step benchmark {pair}: {type(error).__name__}: {error}")
        print(json.dumps(report["train_step"]))
    report["failures"] = failures
    path = write_report(args.out, report)
    print(f"{len(failures)} failures; report in {path}")
    for failure in failures:
        print("FAILED", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
