"""The GPU check's targets, each judged PASS, FAIL or NOT MEASURED from the sections' rows, and the list of what
failed."""

import contextlib
import functools

from .attention import ENVELOPE_LIMIT, ENVELOPE_SHAPES, KERNEL_SPEED_SHAPES, KERNEL_SPEED_TARGETS, PEAK_MEMORY_LIMIT
from .models import COMPILE_PRESETS

# What auto should run on CUDA: the fused kernels, and the decode path for a few queries.
FUSED = {"triton", "decode"}


def find(sections, section, **fields):
    """The first row of a section that ran with these field values, or None."""
    rows = sections.get(section, {}).get("rows", [])
    return next((row for row in rows if all(row.get(key) == value for key, value in fields.items())), None)


def ratio_target(sections, section, fields, value_of, limit):
    row = find(sections, section, **fields)
    try:
        value = value_of(row)
    except (KeyError, TypeError):  # no row, or a row without the measurement (an error)
        return None, None
    return round(value, 3), value <= limit


def fullgraph_target(sections):
    rows = [row for row in sections.get("compile", {}).get("rows", []) if row.get("kind") in ("train-step", "generate")]
    broken = [row["name"] for row in rows if "error" in row or row.get("graph_breaks") != 0]
    if len(rows) < 2 * len(COMPILE_PRESETS):
        return f"{len(rows)} of {2 * len(COMPILE_PRESETS)} compiled", None
    return (f"{len(rows) - len(broken)} of {len(rows)} without graph breaks" + (f" (not: {broken})" if broken else ""),
            not broken)  # fmt: skip


def cuda_graphs_target(sections):
    row = find(sections, "compile", kind="train-step-cuda-graphs")
    if row is None or "skipped" in row:
        return None, None
    return (f"{row['step_ms']:.2f} ms/step" if "step_ms" in row else row["error"]), "step_ms" in row


def peak_memory_target(sections, names=KERNEL_SPEED_SHAPES, limit=PEAK_MEMORY_LIMIT):
    """Peak memory of a forward + backward over SDPA's default backend's at each shape; passed if the largest is
    within ``limit``, not measured unless every shape measured both."""
    ratios = {}
    for name in names:
        row = find(sections, "attention", name=name)
        with contextlib.suppress(KeyError, TypeError):
            ratios[name] = round(row["plat"]["fwd_bwd_peak_mib"] / row["sdpa"]["fwd_bwd_peak_mib"], 3)
    if len(ratios) < len(names):
        return ratios or None, None
    return ratios, max(ratios.values()) <= limit


def fused_target(sections):
    """Which timed p-LaT rows saw auto choose anything but the fused kernels (or the decode path)."""
    rows = [row for name in ("attention", "envelope", "kernels", "train", "compile", "decode")
            for row in sections.get(name, {}).get("rows", [])]  # fmt: skip
    counts = {row["name"]: row.get("plat", row)["backends"] for row in rows if "backends" in row.get("plat", row)}
    fallbacks = {name: chosen for name, chosen in counts.items() if set(chosen) - FUSED}
    if not counts:
        return None, None
    return (f"fall backs in {fallbacks}" if fallbacks else f"{len(counts)} rows on {sorted(FUSED)}"), not fallbacks


LAUNCH_HOST_US = 15


def launch_host_target(sections):
    """The paper-lm kernels row's host microseconds per Triton launch."""
    rows = [row for row in sections.get("kernels", {}).get("rows", []) if row["name"] == "paper-lm" and "host" in row]
    if not rows:
        return None, None
    per_launch = rows[0]["host"]["launch_us"] / rows[0]["host"]["launches"]
    return round(per_launch, 1), per_launch <= LAUNCH_HOST_US


# (name, the sections it needs, judge(sections) -> (value, passed: True / False / None when not measured))
TARGETS = [
    *[(f"{name} training step <= {limit} x {twin} (SDPA), bf16 autocast", ("train",),
       functools.partial(ratio_target, section="train", fields=dict(name=f"plat-{name}"),
                         value_of=lambda row: row["ratio"], limit=limit))
      for name, twin, limit in (("deit-tiny", "ViTForImageClassification", 1.2), ("lm", "GPT2LMHeadModel", 1.15),
                                ("llama-125m", "LlamaForCausalLM", 1.3))],
    ("paper-lm attention forward + backward <= 2.5 x SDPA (default backend)", ("attention",),
     lambda s: ratio_target(s, "attention", dict(name="paper-lm"), lambda row: row["ratio_to_sdpa"]["fwd_bwd"], 2.5)),
    *[(f"{name} attention {'forward' if part == 'fwd' else 'forward + backward'} <= {limit} x SDPA (default backend)",
       ("attention",), functools.partial(ratio_target, section="attention", fields=dict(name=name),
                                         value_of=lambda row, part=part: row["ratio_to_sdpa"][part], limit=limit))
      for name, part, limit in KERNEL_SPEED_TARGETS],
    (f"peak memory of an attention forward + backward <= {PEAK_MEMORY_LIMIT} x SDPA (default backend) at "
     f"{', '.join(KERNEL_SPEED_SHAPES)}", ("attention",), peak_memory_target),
    *[(f"{name} attention forward + backward <= {ENVELOPE_LIMIT} x SDPA given the same pattern", ("envelope",),
       functools.partial(ratio_target, section="envelope", fields=dict(name=name),
                         value_of=lambda row: row["ratio_to_sdpa"]["fwd_bwd"], limit=ENVELOPE_LIMIT))
      for name in ENVELOPE_SHAPES],
    (f"host time per Triton launch <= {LAUNCH_HOST_US} us (paper-lm, median over a call's launches)", ("kernels",),
     launch_host_target),
    ("compiled plat-ptb-tiny training step <= 0.8 x eager", ("compile",),
     lambda s: ratio_target(s, "compile", dict(name="plat-ptb-tiny/train-step"), lambda row: row["ratio_to_eager"],
                            0.8)),
    ("fullgraph=True, 0 graph breaks: training step and generation's forward of plat-ptb-tiny and plat-llama-tiny",
     ("compile",), fullgraph_target),
    ('mode="reduce-overhead" (CUDA graphs) training step of plat-ptb-tiny works', ("compile",), cuda_graphs_target),
    ("auto runs the fused kernels (triton; decode for a few queries) in every timed p-LaT model",
     ("attention", "envelope", "train", "compile", "decode"), fused_target),
]  # fmt: skip


def judge_targets(sections, requested):
    """A PASS / FAIL / NOT MEASURED line per target that the requested sections measure."""
    judged = []
    for name, needs, judge_target in TARGETS:
        if not set(needs) & set(requested):
            continue
        value, passed = judge_target(sections)
        verdict = {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[passed]
        judged.append(dict(target=name, value=value, passed=passed, line=f"{verdict} {name}: {value}"))
    return judged


def collect_failures(sections, targets):
    failures = []
    for name, section in sections.items():
        if section["status"] == "error":
            failures.append(f"{name}: {section['error']}")
        for row in section.get("rows", []):
            label = row.get("case") or row.get("name")
            failures += [f"{name} {label}: {failure}" for failure in row.get("failures", [])]
    return failures + [target["line"] for target in targets if not target["passed"]]
