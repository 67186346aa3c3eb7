"""The sections of whole models: training steps against transformers' twins, torch.compile, decoding with the KV
cache and the README's main job."""

import functools
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from modeling_plat import paper_p_mix
from modeling_plat.plap_dispatch import plap_attention

from .attention import ATTENTION_SHAPES
from .kernels import device_work, host_profile, host_times, kernel_times
from .measure import (ROOT, TOLERANCE, backend_spy, bf16_attention_inputs, error_fields, no_log, paired_ratio,
                      peak_memory_mib, relative_error, side_by_side, synchronize, timed, to_device)  # fmt: skip

TRAIN_BATCHES = {"vision": 64, "lm": 16, "llama-125m": 8}
COMPILE_PRESETS = ("plat-ptb-tiny", "plat-llama-tiny")
# plap_attention compiled against eager, bfloat16, the paper's p mix, each formulation: the paper LM's shape (each
# kernel's exact pass alone) and a causal 2k (first passes, then exact passes).
COMPILED_ATTENTION_SHAPES = {"paper-lm": ATTENTION_SHAPES["paper-lm"], "2k": (2, 4, 2048, 64, True)}
# (formulation, whether Inductor launches the kernels with its static launcher) of the compiled attention rows.
ATTENTION_VARIANTS = (("paper", False), ("euler", False), ("paper", True))
CUDA_GRAPHS_PRESET = "plat-ptb-tiny"
# Steps over which a training step's host time and its kernels are measured, after the timed rounds.
HOST_REPEATS = 3


def training_step(model, optimizer, inputs, device, cuda_graphs=False):
    """One optimizer step under bf16 autocast, as a closure."""

    def step():
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs (loss, grads) are consumed
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def optimizer_step(model, inputs, device):
    """``training_step`` of ``model`` on ``device``, in training mode, with an AdamW of its own."""
    model.to(device).train()
    return training_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), inputs, device)


def step_row(result, step, device, baseline=None, ratio="ratio"):
    """A timed step's fields from its ``side_by_side`` result: the median step, the peak memory of one more step,
    the backends chosen and, against the ``baseline``'s result, ``paired_ratio`` as ``ratio`` and ``ratio_range``."""
    if "error" in result:
        return dict(result)
    row = dict(step_ms=statistics.median(result["seconds"]) * 1e3, backends=dict(result["backends"]))
    if baseline is not None and "seconds" in baseline:
        row[ratio], row["ratio_range"] = paired_ratio(result["seconds"], baseline["seconds"])
    try:
        row["peak_mib"] = peak_memory_mib(step, device)
    except Exception as error:
        row.update(error_fields(error))
    return row


def train_pair(pair, batch_size, device, warmup, repeats, log, host_repeats=HOST_REPEATS):
    """Rows of one bench_train_step pair, its models timed side by side, the last model (transformers' twin) the
    baseline of each ratio; each model's host time, its profile (``host_profile``) and device work measured over
    ``host_repeats`` more steps each."""
    from bench_train_step import PAIRS, batches

    models = PAIRS[pair][0]("auto")
    inputs = to_device(batches(pair, batch_size), device)
    steps = {name: optimizer_step(model, inputs, device) for name, model in models.items()}
    results = side_by_side(steps, device, warmup, repeats)
    baseline = list(models)[-1]
    rows = []
    for name, model in models.items():
        row = dict(name=name, pair=pair, batch=batch_size, parameters=sum(p.numel() for p in model.parameters()),
                   baseline=baseline)  # fmt: skip
        row.update(step_row(results[name], steps[name], device, results[baseline]))
        if "error" not in row:
            try:
                row.update(host=host_times(steps[name], device, host_repeats),
                           host_profile=host_profile(steps[name], device, host_repeats),
                           work=device_work(steps[name], device, host_repeats))  # fmt: skip
            except Exception as error:
                row.update(error_fields(error))
        log(f"train {name}: {row.get('step_ms', row.get('error'))} ms, {row.get('ratio')} x {baseline} (paired; "
            f"range {row.get('ratio_range')}), host {row.get('host', {}).get('call_us')} us, device work "
            f"{row.get('work')}, backends {row.get('backends')}")
        rows.append(row)
    for model in models.values():
        model.cpu()
    return rows


def train_section(device, log, batches=TRAIN_BATCHES, warmup=3, repeats=10, host_repeats=HOST_REPEATS):
    rows = []
    for pair, batch_size in batches.items():
        try:
            rows.extend(train_pair(pair, batch_size, device, warmup, repeats, log, host_repeats))
        except Exception as error:
            rows.append(dict(name=pair, pair=pair, **error_fields(error)))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def train_jobs(device, batches=TRAIN_BATCHES):
    """The train section's pairs, each run once untimed: precompilation's jobs (``precompile``)."""
    return [(f"train {pair}", functools.partial(train_pair, pair, batch_size, device, 0, 1, no_log, 1))
            for pair, batch_size in batches.items()]  # fmt: skip


def dynamo_counts():
    from torch._dynamo.utils import counters

    return dict(graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))


def fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def first_call_seconds(step, device):
    """Seconds of step()'s first call: the compile."""
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def compiled_step_row(preset, compiled, eager, inputs, device, warmup, repeats):
    """The compiled model's first step (the compile) alone, then its steps and the eager model's side by side."""
    row = dict(name=f"{preset}/train-step", kind="train-step", preset=preset)
    eager_step = optimizer_step(eager, inputs, device)
    fresh_dynamo()
    step = optimizer_step(compiled, inputs, device)
    with backend_spy() as chosen:
        first_s = first_call_seconds(step, device)
    results = side_by_side({"compiled": step, "eager": eager_step}, device, warmup, repeats)
    if "backends" in results["compiled"]:
        results["compiled"]["backends"].update(chosen)  # chosen while tracing, in the first call
    row.update(eager=step_row(results["eager"], eager_step, device), first_call_s=first_s, **dynamo_counts())
    row.update(step_row(results["compiled"], step, device, results["eager"], ratio="ratio_to_eager"))
    return row


def cuda_graphs_row(preset, eager, inputs, device, warmup, repeats):
    row = dict(name=f"{preset}/train-step-cuda-graphs", kind="train-step-cuda-graphs", preset=preset)
    if device.type != "cuda":
        return dict(row, skipped="CUDA graphs need a CUDA device")
    fresh_dynamo()
    graphed = torch.compile(eager, fullgraph=True, mode="reduce-overhead")
    step = training_step(graphed, torch.optim.AdamW(eager.parameters(), lr=1e-4), inputs, device, cuda_graphs=True)
    with backend_spy() as chosen:
        first_s = first_call_seconds(step, device)
        seconds = timed(step, warmup, repeats, device)
    row.update(first_call_s=first_s, step_ms=seconds * 1e3, backends=dict(chosen), **dynamo_counts())
    return row


def compiled_generation_row(preset, model, device, compiler, new_tokens):
    """Greedy decoding with model.forward compiled (fullgraph) against eager decoding."""
    model.to(device).eval()
    prompt = torch.randint(2, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0)).to(device)
    generate = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        expected = model.generate(prompt, **generate)
        fresh_dynamo()
        model.forward = torch.compile(model.forward, backend=compiler, fullgraph=True)
        try:
            with backend_spy() as chosen:
                start = time.perf_counter()
                tokens = model.generate(prompt, **generate)
                seconds = time.perf_counter() - start
        finally:
            del model.forward  # the class's forward again
    return dict(name=f"{preset}/generate", kind="generate", preset=preset, new_tokens=new_tokens, seconds=seconds,
                tokens_equal_eager=torch.equal(tokens, expected), backends=dict(chosen), **dynamo_counts())  # fmt: skip


def attention_row_name(shape_name, formulation, static_launch):
    return f"{shape_name}/attention-{formulation}" + ("-static-launch" if static_launch else "")


def compiled_attention_row(name, shape, formulation, device, compiler, warmup, repeats, static_launch=False):
    """plap_attention's output and the gradients of q, k and v, compiled (fullgraph) against eager on the same inputs:
    on a GPU the fused kernels as Inductor launches them, with their arguments functionalized (each tensor a kernel
    writes is a clone, which Inductor's reinplacing turns back into the tensor where nothing reads it after:
    tools/kernels/compiled_graph.py), which an argument that aliased a written one would break. ``timing``: the
    compiled forward + backward against the eager one, side by side, each p-LaT kernel's microseconds per call in
    both (``plap_kernel_us``, over HOST_REPEATS calls: Inductor compiles the kernels without their register caps,
    docs/models.md), and the other kernels of a call in both (``other_kernels``: how many, their microseconds, their
    names), where a copy or an operation that one side fuses and the other does not shows. ``static_launch``: Inductor
    launches the kernels with its own launcher (``static_launch_user_defined_triton_kernels``, off by default in torch
    2.13: user kernels then go through Triton's), the host cost its compiled calls pay per launch."""
    batch, heads, length, head_dim, causal = shape
    q, k, v, grad_out = bf16_attention_inputs(batch, heads, length, head_dim, device)
    p = tuple(paper_p_mix(heads))
    row = dict(name=attention_row_name(name, formulation, static_launch), kind="attention", formulation=formulation,
               static_launch=static_launch, batch=batch, heads=heads, length=length, head_dim=head_dim,
               causal=causal)  # fmt: skip

    def attend(q, k, v):
        return plap_attention(q, k, v, p, is_causal=causal, formulation=formulation)

    def forward_backward(attend):
        out = attend(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

    expected = forward_backward(attend)
    fresh_dynamo()
    compiled_attend = torch.compile(attend, backend=compiler, fullgraph=True)
    # Strict: a kernel that Inductor's launcher cannot take fails the row with the reason, rather than falling back.
    launcher = torch._inductor.config.patch(static_launch_user_defined_triton_kernels=static_launch,
                                            strict_static_cuda_launcher=static_launch)  # fmt: skip
    with backend_spy() as chosen, launcher:  # the first call compiles both graphs
        compiled = forward_backward(compiled_attend)
    errors = {part: relative_error(ours, reference)
              for part, ours, reference in zip(("out", "grad_q", "grad_k", "grad_v"), compiled, expected)}  # fmt: skip
    tolerance = TOLERANCE["bfloat16"]
    row.update(errors=errors, tolerance=tolerance, backends=dict(chosen), **dynamo_counts())
    row["failures"] = [f"{part}: relative error {error:.2e} > {tolerance}" for part, error in errors.items()
                       if not error <= tolerance]  # fmt: skip
    steps = {"compiled": lambda: forward_backward(compiled_attend), "eager": lambda: forward_backward(attend)}
    results = side_by_side(steps, device, warmup, repeats)
    row["timing"] = step_row(results["compiled"], steps["compiled"], device, results["eager"], ratio="ratio_to_eager")
    if "seconds" in results["eager"]:
        row["timing"]["eager_ms"] = statistics.median(results["eager"]["seconds"]) * 1e3
    try:
        kernels = {name: kernel_times(step, device, HOST_REPEATS) for name, step in steps.items()}
        row["timing"]["plap_kernel_us"] = {
            kernel: {name: kernels[name].get(kernel, {}).get("us") for name in steps}
            for kernel in sorted({*kernels["compiled"], *kernels["eager"]}) if kernel.startswith("plap_")
        }  # fmt: skip
        row["timing"]["other_kernels"] = {name: other_kernels(kernels[name]) for name in steps}
    except Exception as error:
        row["timing"].update(error_fields(error))
    return row


def other_kernels(kernels):
    """What ``kernel_times`` measured of a call's kernels other than p-LaT's: launches and microseconds per call,
    and their names."""
    others = {name: kernel for name, kernel in kernels.items() if not name.startswith("plap_")}
    return dict(launches=sum(kernel["launches"] for kernel in others.values()),
                us=sum(kernel["us"] for kernel in others.values()), names=sorted(others))  # fmt: skip


def preset_row(preset, kind, device, compiler, batch, warmup, repeats, new_tokens):
    """One of a preset's rows of the compile section, on models of its own (``compile_pair``): its training step
    compiled against eager ("train-step"), with CUDA graphs ("train-step-cuda-graphs") or greedy generation with its
    forward compiled ("generate")."""
    from bench_train_step import batches, compile_pair

    compiled, eager = compile_pair(preset, backend=compiler)("auto").values()
    if kind == "generate":
        return compiled_generation_row(preset, eager, device, compiler, new_tokens)
    inputs = to_device(batches("compile", batch), device)
    if kind == "train-step":
        return compiled_step_row(preset, compiled, eager, inputs, device, warmup, repeats)
    return cuda_graphs_row(preset, eager, inputs, device, warmup, repeats)


def compile_runs(device, presets=COMPILE_PRESETS, cuda_graphs_preset=CUDA_GRAPHS_PRESET, compiler="inductor", batch=32,
                 warmup=3, repeats=10, new_tokens=12, attention_shapes=COMPILED_ATTENTION_SHAPES):  # fmt: skip
    """(fields, run) of each row of the compile section, run() -> the row, ``fields`` the name and kind that a row
    which raised keeps: plap_attention compiled at each of ``attention_shapes`` in each of ``ATTENTION_VARIANTS``,
    then each preset's training step and generation, and the ``cuda_graphs_preset``'s training step under CUDA
    graphs."""
    runs = []
    for (name, shape), (formulation, static_launch) in itertools.product(attention_shapes.items(),
                                                                         ATTENTION_VARIANTS):  # fmt: skip
        runs.append((dict(name=attention_row_name(name, formulation, static_launch), kind="attention"),
                     functools.partial(compiled_attention_row, name, shape, formulation, device, compiler, warmup,
                                       repeats, static_launch)))  # fmt: skip
    for preset in presets:
        kinds = ("train-step", "train-step-cuda-graphs") if preset == cuda_graphs_preset else ("train-step",)
        for kind in (*kinds, "generate"):
            runs.append((dict(name=f"{preset}/{kind}", kind=kind, preset=preset),
                         functools.partial(preset_row, preset, kind, device, compiler, batch, warmup, repeats,
                                           new_tokens)))  # fmt: skip
    return runs


# What the compile section's log shows of a row, where it has them.
COMPILE_LOGGED = ("errors", "first_call_s", "step_ms", "ratio_to_eager", "ratio_range", "graphs", "graph_breaks",
                  "tokens_equal_eager", "backends", "timing", "skipped", "error")  # fmt: skip


def compile_section(device, log, **options):
    """The rows of ``compile_runs(device, **options)``, one after the other."""
    rows = []
    for fields, run in compile_runs(device, **options):
        try:
            rows.append(run())
        except Exception as error:
            rows.append(dict(fields, **error_fields(error)))
        log(f"compile {rows[-1]['name']}: " + json.dumps({key: rows[-1][key] for key in COMPILE_LOGGED
                                                          if key in rows[-1]}))  # fmt: skip
    fresh_dynamo()
    return rows


def compile_jobs(device, **options):
    """The compile section's rows (``compile_runs``), each run once untimed: precompilation's jobs (``precompile``)."""
    runs = compile_runs(device, **dict(options, warmup=0, repeats=1))
    return [(f"compile {fields['name']}", run) for fields, run in runs]


def decode_section(device, log, shapes=("gpt2", "llama"), batch_sizes=(1, 8), new_tokens=100, repeats=3,
                   dtype=torch.bfloat16):  # fmt: skip
    from bench_decode import BASELINE, decode_seconds, models

    rows = []
    for shape in shapes:
        try:
            built = {name: model.to(device, dtype) for name, model in models(shape).items()}
        except Exception as error:
            rows.append(dict(name=shape, shape=shape, **error_fields(error)))
            continue
        for batch in batch_sizes:
            prompt = torch.randint(1, 10000, (batch, 16), generator=torch.Generator().manual_seed(batch)).to(device)
            shape_rows = {}
            for name, model in built.items():
                row = dict(name=f"{shape}/{name}/batch{batch}", shape=shape, model=name, batch=batch,
                           new_tokens=new_tokens, dtype=str(dtype).removeprefix("torch."))  # fmt: skip
                try:
                    decode_seconds(model, prompt, 8)  # warm-up
                    with backend_spy() as chosen:
                        seconds = statistics.median(decode_seconds(model, prompt, new_tokens) for _ in range(repeats))
                    row.update(seconds=seconds, tokens_per_s=batch * new_tokens / seconds, backends=dict(chosen))
                except Exception as error:
                    row.update(error_fields(error))
                shape_rows[name] = row
            for row in shape_rows.values():
                if "seconds" in row and "seconds" in shape_rows[BASELINE]:
                    row["ratio_to_transformers"] = row["seconds"] / shape_rows[BASELINE]["seconds"]
                log(f"decode {row['name']}: {row.get('tokens_per_s', row.get('error'))} tokens/s")
            rows.extend(shape_rows.values())
    return rows


def main_job_arguments(output_dir, device):
    """run_clm.py's arguments for the README's main job, in bfloat16 on a GPU."""
    bf16 = ["--bf16", "true"] if device.type == "cuda" else []
    return ["plat-ptb-tiny.yaml", "--output_dir", str(output_dir), *bf16]


def main_job_section(device, log, timeout_s, script=ROOT / "run_clm.py", extra_args=()):
    with tempfile.TemporaryDirectory() as folder:
        output_dir = Path(folder) / "plat-ptb-tiny"
        command = [sys.executable, str(script), *main_job_arguments(output_dir, device), *extra_args]
        row = dict(name="plat-ptb-tiny", command=" ".join(command[1:]), timeout_s=timeout_s)
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or b"")[-3000:]
            return [dict(row, wall_s=time.perf_counter() - start, failures=[f"timed out after {timeout_s:.0f} s"],
                         output_tail=output.decode(errors="replace") if isinstance(output, bytes) else output)]
        row.update(wall_s=time.perf_counter() - start, returncode=done.returncode,
                   output_tail=(done.stdout + done.stderr)[-3000:])  # fmt: skip
        results = output_dir / "all_results.json"
        if done.returncode == 0 and results.exists():
            row["metrics"] = json.loads(results.read_text())
        else:
            row["failures"] = [f"exit status {done.returncode}" + ("" if results.exists() else ", no all_results.json")]
    log(f"main job: {row['wall_s']:.0f} s, test perplexity {row.get('metrics', {}).get('test_perplexity')}")
    return [row]
