#!/usr/bin/env python
"""The small-scale reproduction grid: attention variants x seeds x tasks, at an equal step budget per task.

Every cell is one subprocess call of a training script on a preset of this repository, with only p and
the formulation overridden:

    python run_clm.py --config_name plat-ptb-tiny --config_overrides "plap_p=2.0,plap_formulation=paper" \
        --output_dir runs/grid/ptb/softmax/seed0 --do_train --do_eval --max_steps 300 --seed 0 ...

Cells whose results exist are skipped, so an interrupted grid resumes where it stopped. After the cells
have run, the grid is summarised into ``--results_dir``: ``grid.md`` (mean ± std over seeds, the difference
to the softmax baseline and whether it exceeds the seed spread, the cost per variant), ``grid.json`` and
PNGs (learning curves, final metric per variant with error bars), plus the spectral diagnostics of the
first seed's models (``plat_train.diagnostics``). See experiments/README.md.
"""

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from modeling_plat import paper_p_mix

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Task:
    script: str
    preset: str
    diagnostics_task: str
    metric: str  # the headline metric in all_results.json
    validation_metric: str
    higher_is_better: bool
    default_steps: int
    # The shared recipe. The default budgets make one cell 4-6 minutes on one CPU core (experiments/README.md).
    recipe: tuple


TASKS = {
    "ptb": Task(
        script="run_clm.py", preset="plat-ptb-tiny", diagnostics_task="text",
        metric="test_perplexity", validation_metric="eval_perplexity", higher_is_better=False, default_steps=150,
        recipe=("--per_device_train_batch_size", "32", "--per_device_eval_batch_size", "64",
                "--learning_rate", "3e-3", "--weight_decay", "0.1", "--warmup_steps", "0.05",
                "--lr_scheduler_type", "cosine"),
    ),
    "fmnist": Task(
        script="run_image_classification.py", preset="plat-fmnist-tiny", diagnostics_task="image",
        metric="test_top1_accuracy", validation_metric="eval_top1_accuracy", higher_is_better=True,
        default_steps=500,
        recipe=("--per_device_train_batch_size", "128", "--per_device_eval_batch_size", "500",
                "--learning_rate", "1e-3", "--weight_decay", "0.05", "--warmup_steps", "0.05",
                "--lr_scheduler_type", "cosine", "--crop_scale_min", "0.6"),
    ),
}

# Variant: (p for every head, or "mix" for the paper's half 1.5 / half 2.5 heads; formulation).
VARIANT_SPECS = {
    "softmax": (2.0, "paper"),
    "paper_mix": ("mix", "paper"),
    "all_1.5": (1.5, "paper"),
    "all_2.5": (2.5, "paper"),
    "euler_mix": ("mix", "euler"),
}
VARIANTS = tuple(VARIANT_SPECS)
BASELINE = "softmax"


def variant_overrides(variant, num_heads):
    """The config overrides of a variant: p per head and the formulation; nothing else changes."""
    p, formulation = VARIANT_SPECS[variant]
    p_text = json.dumps(paper_p_mix(num_heads) if p == "mix" else p).replace(" ", "")
    return f"plap_p={p_text},plap_formulation={formulation}"


def preset_heads(task):
    return json.loads((REPO / "configuration" / f"{task.preset}.json").read_text())["num_attention_heads"]


# --- Running cells ---------------------------------------------------------------------------------------


def shown(text):
    """``text`` as a reader of the results should see it: python by name, paths inside this repository relative."""
    return str(text).replace(sys.executable, "python").replace(f"{REPO}{os.sep}", "")


def cell_dir(runs_dir, task_name, variant, seed):
    return Path(runs_dir) / task_name / variant / f"seed{seed}"


def cell_command(task, variant, seed, steps, output_dir, extra_args):
    return [
        sys.executable, str(REPO / task.script),
        "--config_name", task.preset,
        "--config_overrides", variant_overrides(variant, preset_heads(task)),
        "--output_dir", str(output_dir),
        "--do_train", "--do_eval",
        "--max_steps", str(steps),
        "--seed", str(seed),
        "--logging_steps", str(max(1, steps // 25)),
        "--save_strategy", "no",
        "--report_to", "none",
        *task.recipe,
        *extra_args,
    ]


def log_history(output_dir):
    """The training log Trainer keeps in trainer_state.json: one entry per logging step, then its summary."""
    return json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]


def cost_from_trainer_state(output_dir):
    """Steps, training seconds and seconds per step from the final entry of trainer_state.json's log."""
    summary = next(entry for entry in reversed(log_history(output_dir)) if "train_runtime" in entry)
    steps = summary["step"]
    return {"steps": steps, "train_runtime": summary["train_runtime"],
            "seconds_per_step": summary["train_runtime"] / steps}


def run_cell(task_name, variant, seed, steps, runs_dir, extra_args):
    """Train and evaluate one cell unless its cell.json exists; returns that record."""
    task = TASKS[task_name]
    output_dir = cell_dir(runs_dir, task_name, variant, seed)
    record_path = output_dir / "cell.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    if output_dir.exists():
        # A cell that stopped part-way: the scripts refuse a non-empty folder without checkpoints.
        shutil.rmtree(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = output_dir.with_suffix(".log")  # beside the folder, which the script wants empty
    command = cell_command(task, variant, seed, steps, output_dir, extra_args)
    print(f"[{task_name} {variant} seed {seed}] {shown(shlex.join(command))}", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        returncode = subprocess.call(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    wall_time = time.perf_counter() - start
    if returncode != 0:
        print(f"  failed (exit {returncode}); see {log_path}", flush=True)
        return None
    record = {
        "task": task_name, "variant": variant, "seed": seed, "max_steps": steps,
        "config_overrides": variant_overrides(variant, preset_heads(task)), "command": shown(shlex.join(command)),
        "wall_time": wall_time, **cost_from_trainer_state(output_dir),
        "results": json.loads((output_dir / "all_results.json").read_text()),
    }
    record_path.write_text(json.dumps(record, indent=2))
    print(f"  done in {wall_time:.0f} s: {task.metric} = {record['results'].get(task.metric)}", flush=True)
    return record


# --- Summaries -------------------------------------------------------------------------------------------


def mean_std(values):
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def summarize_task(task_name, records):
    """Per variant: mean and std over seeds of the metrics and the cost, and the difference to the baseline."""
    task = TASKS[task_name]
    rows = {}
    for variant in VARIANTS:
        done = [r for r in records if r["variant"] == variant]
        if not done:
            continue
        row = {"seeds": sorted(r["seed"] for r in done), "overrides": done[0]["config_overrides"]}
        for name, values in (
            ("metric", [r["results"][task.metric] for r in done]),
            ("validation_metric", [r["results"][task.validation_metric] for r in done]),
            ("seconds_per_step", [r["seconds_per_step"] for r in done]),
            ("max_grad_norm", [r["max_grad_norm"] for r in done]),
            ("wall_time", [r["wall_time"] for r in done]),
        ):
            row[name], row[f"{name}_std"] = mean_std(values)
        rows[variant] = row
    baseline = rows.get(BASELINE)
    for variant, row in rows.items():
        if baseline is None or variant == BASELINE:
            continue
        row["difference"] = row["metric"] - baseline["metric"]
        row["relative_cost"] = row["seconds_per_step"] / baseline["seconds_per_step"]
        spread = row["metric_std"] + baseline["metric_std"]
        # +-1 std error bars that do not overlap; undecidable with a single seed.
        row["beyond_seed_spread"] = None if spread != spread else abs(row["difference"]) > spread
    return {"metric": task.metric, "higher_is_better": task.higher_is_better, "variants": rows}


def _fmt(mean, std, digits):
    return f"{mean:.{digits}f}" if std != std else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_table(task_name, summary, steps):
    task = TASKS[task_name]
    digits = 3 if task.higher_is_better else 1
    better = "higher" if task.higher_is_better else "lower"
    lines = [
        f"## {task_name}: `{task.preset}` preset, {steps} steps per run, via `{task.script}`",
        "",
        f"Headline metric `{task.metric}` ({better} is better); mean ± std over seeds. \"Beyond spread\": "
        f"|difference| > std(variant) + std({BASELINE}). \"Largest gradient norm\": the largest logged norm of a "
        "run's gradient before clipping (to 1.0).",
        "",
        f"| variant | overrides | seeds | {task.metric} | difference to {BASELINE} | beyond spread | "
        f"{task.validation_metric} | s / step | cost vs {BASELINE} | wall s / run | largest gradient norm |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, row in summary["variants"].items():
        difference = "" if "difference" not in row else f"{row['difference']:+.{digits}f}"
        beyond = {None: "n/a (1 seed)", True: "yes", False: "no"}.get(row.get("beyond_seed_spread", ""), "")
        cost = "" if "relative_cost" not in row else f"{row['relative_cost']:.2f}x"
        lines.append(
            f"| {variant} | `{row['overrides']}` | {len(row['seeds'])} | "
            f"{_fmt(row['metric'], row['metric_std'], digits)} | {difference} | {beyond} | "
            f"{_fmt(row['validation_metric'], row['validation_metric_std'], digits)} | "
            f"{_fmt(row['seconds_per_step'], row['seconds_per_step_std'], 3)} | {cost} | "
            f"{_fmt(row['wall_time'], row['wall_time_std'], 0)} | "
            f"{_fmt(row['max_grad_norm'], row['max_grad_norm_std'], 2)} |"
        )
    return "\n".join(lines)


def max_grad_norm(output_dir):
    """The largest gradient norm Trainer logged (before clipping): how close a run came to diverging."""
    return max(entry["grad_norm"] for entry in log_history(output_dir) if "grad_norm" in entry)


def learning_curves(output_dir):
    """(steps, training losses) and (steps, validation losses) from trainer_state.json's log history."""
    history = log_history(output_dir)
    train = [(e["step"], e["loss"]) for e in history if "loss" in e]
    validation = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
    return train, validation


def plot_task(task_name, records, summary, runs_dir, results_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    task = TASKS[task_name]
    variants = list(summary["variants"])
    colors = dict(zip(VARIANTS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in variants:
        curves = [learning_curves(cell_dir(runs_dir, task_name, variant, r["seed"]))
                  for r in records if r["variant"] == variant]
        for index, (train, validation) in enumerate(curves):
            label = variant if index == 0 else None
            ax.plot(*zip(*train), color=colors[variant], alpha=0.8, lw=1, label=label)
            if validation:
                ax.plot(*zip(*validation), "o--", color=colors[variant], ms=3, lw=1)
    ax.set(xlabel="step", ylabel="training loss (lines), validation loss (dashed, if evaluated)", yscale="log",
           title=f"{task_name}: learning curves, every seed")
    ax.legend()
    paths.append(_save(fig, Path(results_dir) / f"{task_name}_learning_curves.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(variants))
    rows = [summary["variants"][v] for v in variants]
    per_seed = {"metric": lambda r: r["results"][task.metric], "seconds_per_step": lambda r: r["seconds_per_step"]}
    for ax, key, label in ((axes[0], "metric", task.metric), (axes[1], "seconds_per_step", "seconds per step")):
        means = [row[key] for row in rows]
        stds = [0 if row[f"{key}_std"] != row[f"{key}_std"] else row[f"{key}_std"] for row in rows]
        ax.errorbar(x, means, yerr=stds, fmt="o", capsize=5, color="black")
        for i, variant in enumerate(variants):
            values = [per_seed[key](r) for r in records if r["variant"] == variant]
            ax.scatter([i] * len(values), values, color=colors[variant], s=18, zorder=3)
        ax.set_xticks(x, variants, rotation=20)
        ax.set(ylabel=label, title=f"{task_name}: {label} (mean ± std over seeds, dots: seeds)")
    paths.append(_save(fig, Path(results_dir) / f"{task_name}_final.png"))
    return paths


def _save(fig, path):
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_diagnostics(task_name, records, runs_dir, results_dir):
    """Spectral diagnostics of each variant's first-seed model, one plot per quantity."""
    from plat_train import diagnostics

    first = {}
    for record in sorted(records, key=lambda r: r["seed"]):
        # Relative to the working directory, so that diagnostics.json names no folder of this machine.
        first.setdefault(record["variant"],
                         os.path.relpath(cell_dir(runs_dir, task_name, record["variant"], record["seed"])))
    diagnostics.run(first, TASKS[task_name].diagnostics_task, Path(results_dir) / "diagnostics" / task_name)


def write_raw_runs(task_name, records, runs_dir, results_dir):
    """Each run's record with its full training log, so that the tables and plots can be checked without runs/."""
    folder = results_dir / "runs" / task_name
    folder.mkdir(parents=True, exist_ok=True)
    for record in records:
        history = log_history(cell_dir(runs_dir, task_name, record["variant"], record["seed"]))
        path = folder / f"{record['variant']}-seed{record['seed']}.json"
        path.write_text(json.dumps({**record, "command": shown(record["command"]), "log_history": history}, indent=1))


def summarize(task_names, steps, runs_dir, results_dir, with_diagnostics):
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    sections, summaries = ["# p-LaT small-scale grid", "",
                           f"Generated by `experiments/run_grid.py` from the runs in `{shown(runs_dir)}`.", ""], {}
    for task_name in task_names:
        records = [json.loads(p.read_text()) for p in sorted(Path(runs_dir, task_name).glob("*/seed*/cell.json"))]
        records = [r for r in records if r["max_steps"] == steps[task_name]]
        if not records:
            continue
        for record in records:
            record["max_grad_norm"] = max_grad_norm(cell_dir(runs_dir, task_name, record["variant"], record["seed"]))
        summary = summarize_task(task_name, records)
        summaries[task_name] = summary
        write_raw_runs(task_name, records, runs_dir, results_dir)
        sections += [markdown_table(task_name, summary, steps[task_name]), ""]
        for path in plot_task(task_name, records, summary, runs_dir, results_dir):
            sections.append(f"![{path.stem}]({path.name})")
        if with_diagnostics:
            run_diagnostics(task_name, records, runs_dir, results_dir)
            sections.append(f"\nSpectral diagnostics of the first seed's models: `diagnostics/{task_name}/`.")
        sections.append("")
    (results_dir / "grid.md").write_text("\n".join(sections))
    (results_dir / "grid.json").write_text(json.dumps(summaries, indent=2))
    print(f"Summary in {results_dir / 'grid.md'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    for name, task in TASKS.items():
        parser.add_argument(f"--{name}_steps", type=int, default=task.default_steps,
                            help=f"max_steps of every {name} cell (default {task.default_steps})")
        parser.add_argument(f"--{name}_args", default="",
                            help=f"extra flags for {task.script}, e.g. \"--max_eval_samples 64\"")
    parser.add_argument("--train_args", default="",
                        help="extra flags for every cell, e.g. \"--bf16 --dataloader_num_workers 4\" on a GPU")
    parser.add_argument("--runs_dir", default=str(REPO / "runs" / "grid"))
    parser.add_argument("--results_dir", default=str(REPO / "results"))
    parser.add_argument("--summarize_only", action="store_true", help="tables and plots from existing runs")
    parser.add_argument("--diagnostics", action=argparse.BooleanOptionalAction, default=True,
                        help="also run plat_train.diagnostics on each variant's first-seed model")
    parser.add_argument("--dry_run", action="store_true", help="print the cell commands and stop")
    args = parser.parse_args(argv)

    steps = {name: getattr(args, f"{name}_steps") for name in TASKS}
    failed = []
    for task_name in args.tasks:
        task = TASKS[task_name]
        if not (REPO / task.script).is_file():
            print(f"Skipping {task_name}: {task.script} is not in this checkout", flush=True)
            continue
        extra = shlex.split(args.train_args) + shlex.split(getattr(args, f"{task_name}_args"))
        for seed in args.seeds:
            for variant in args.variants:
                output_dir = cell_dir(args.runs_dir, task_name, variant, seed)
                if args.dry_run:
                    print(shown(shlex.join(cell_command(task, variant, seed, steps[task_name], output_dir, extra))))
                elif not args.summarize_only and run_cell(task_name, variant, seed, steps[task_name],
                                                          args.runs_dir, extra) is None:
                    failed.append((task_name, variant, seed))
    if args.dry_run:
        return
    # Every task with runs at its budget, not only those just run: grid.md describes the whole runs folder.
    summarize(list(TASKS), steps, args.runs_dir, args.results_dir, args.diagnostics)
    if failed:
        sys.exit(f"{len(failed)} cell(s) failed: {failed}")


if __name__ == "__main__":
    main()
