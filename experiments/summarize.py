#!/usr/bin/env python
"""Summarise the study of experiments/protocol.py from the runs folder that run_grid.py fills.

    python experiments/summarize.py --runs_dir runs/study --results_dir results

Writes into ``--results_dir``: ``study.md`` (the learning-rate selection, every arm's primary endpoint with a
95% interval, each comparison's paired difference with its interval, sign count, p-value and Holm-adjusted
p-value, the gap at fixed points of training), ``study.json`` (the same numbers), ``runs/<task>/`` (each run's
record with its whole training log) and PNGs: learning curves with bands and the paired gap along training,
and every seed's endpoint per arm. ``--diagnostics`` adds the per-head diagnostics of experiments/diagnostics.py
on every seed's final model.
"""

import argparse
import json
import math
from pathlib import Path

import paired_stats
import protocol
from protocol import BASELINE, COMPARISONS, TASKS, VARIANTS

REPO = protocol.REPO


def read_records(runs_dir, task):
    """Every finished cell of ``task``: its record plus the training log of its trainer_state.json."""
    records = []
    for path in sorted(Path(runs_dir, task).glob("*/lr*-seed*/cell.json")):
        record = json.loads(path.read_text())
        record["log_history"] = json.loads((path.parent / "trainer_state.json").read_text())["log_history"]
        records.append(record)
    return records


def study_cells(records):
    """{variant: {seed: record}} of the cells that the protocol compares (main and control phases)."""
    cells = {}
    for record in records:
        if record["phase"] in ("main", "control"):
            cells.setdefault(record["variant"], {})[record["seed"]] = record
    return cells


def selection_results(task, records):
    """{selection cell: its results} of the finished selection runs, as protocol.choose_learning_rate reads them."""
    return {protocol.Cell(task, record["variant"], record["lr"], record["seed"], "selection"): record["results"]
            for record in records if record["phase"] == "selection"}


def selection_table(task, records):
    """Per main arm: the selection metric of each learning rate at the selection seed, and the one chosen."""
    spec = TASKS[task]
    results = selection_results(task, records)
    return {arm: {"scores": {cell.lr: results[cell][spec.selection] for cell in protocol.selection_cells(task)
                             if cell.variant == arm and cell in results},
                  "chosen": protocol.choose_learning_rate(task, arm, results)}
            for arm in protocol.ARMS}


def curve(record, task):
    """(steps, values) of the validation curve: perplexity for PTB, top-1 accuracy for Fashion-MNIST."""
    spec = TASKS[task]
    points = {entry["step"]: entry[spec.curve] for entry in record["log_history"] if spec.curve in entry}
    steps = sorted(points)
    values = [math.exp(points[s]) if spec.curve_is_loss else points[s] for s in steps]
    return steps, values


def progress(task, records):
    """How much of the protocol's plan for ``task`` has finished: counts and the names of the missing cells."""
    finished = {(record["variant"], record["lr"], record["seed"]) for record in records}
    planned = protocol.planned_cells(selection_results(task, records), (task,))
    missing = [f"{cell.variant}/lr{cell.lr}-seed{cell.seed}" if cell
               else "a cell waiting for the learning-rate selection"
               for cell in planned if cell is None or (cell.variant, cell.lr, cell.seed) not in finished]
    return {"planned": len(planned), "finished": len(planned) - len(missing), "missing": missing}


def arm_summary(task, cells):
    spec = TASKS[task]
    summary = {}
    for variant in VARIANTS:
        runs = cells.get(variant, {})
        if not runs:
            continue
        values = [runs[seed]["results"][spec.primary] for seed in sorted(runs)]
        mean, low, high = paired_stats.mean_interval(values)
        largest_gradients = [max(entry.get("grad_norm", 0.0) for entry in runs[seed]["log_history"])
                             for seed in sorted(runs)]
        summary[variant] = {"seeds": sorted(runs), "lr": next(iter(runs.values()))["lr"], "values": values,
                            "largest_grad_norm": largest_gradients,
                            "mean": mean, "ci_low": low, "ci_high": high}
    return summary


def comparisons(task, cells):
    """Each protocol comparison over the seeds both arms have, paired by seed."""
    spec = TASKS[task]
    found = []
    for variant, reference in COMPARISONS:
        seeds = sorted(set(cells.get(variant, {})) & set(cells.get(reference, {})))
        if len(seeds) < 2:
            continue
        result = paired_stats.paired_comparison([cells[variant][s]["results"][spec.primary] for s in seeds],
                                                [cells[reference][s]["results"][spec.primary] for s in seeds])
        # The variant is ahead on a seed when the difference goes the metric's good way.
        ahead = result["positive"] if spec.higher_is_better else result["negative"]
        found.append({"task": task, "variant": variant, "reference": reference, "metric": spec.primary,
                      "seeds": seeds, "variant_ahead": ahead, **result})
    return found


def gap_along_training(task, cells, variant="paper_mix", reference=BASELINE):
    """At every validation step: the paired difference variant - reference with its 95% interval."""
    runs, refs = cells.get(variant, {}), cells.get(reference, {})
    seeds = sorted(set(runs) & set(refs))
    if len(seeds) < 2:
        return []
    curves = {seed: (dict(zip(*curve(runs[seed], task))), dict(zip(*curve(refs[seed], task)))) for seed in seeds}
    steps = sorted(set.intersection(*(set(a) & set(b) for a, b in curves.values())))
    gaps = []
    for step in steps:
        result = paired_stats.paired_comparison([curves[s][0][step] for s in seeds], [curves[s][1][step] for s in seeds])
        gaps.append({"step": step, **{k: result[k] for k in ("n", "mean_difference", "ci_low", "ci_high", "p_value")}})
    return gaps


# --- Report ----------------------------------------------------------------------------------------------


def _p(value):
    """A p-value as a reader compares it with 0.05: three decimals, or two significant digits below 0.001."""
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}"


def _number(value, digits):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def progress_line(done):
    if not done["missing"]:
        return f"All {done['planned']} cells of the protocol finished."
    return (f"**Incomplete: {done['finished']} of {done['planned']} cells finished.** The intervals and p-values "
            f"below come from the finished cells only and will move as the rest finish. Missing: "
            + ", ".join(f"`{name}`" for name in done["missing"]) + ".")


def markdown(task, done, selection, arms, found, gaps):
    spec = TASKS[task]
    digits = 4 if spec.higher_is_better else 1
    better = "higher" if spec.higher_is_better else "lower"
    lines = [f"## {task}: `{spec.preset}`, {spec.steps} steps, `{spec.script}`", "", progress_line(done), "",
             f"Primary endpoint `{spec.primary}` ({better} is better).", "",
             f"Learning rate chosen on `{spec.selection}` at seed {protocol.SELECTION_SEED}:", "",
             "| arm | " + " | ".join(f"lr {lr}" for lr in protocol.LEARNING_RATES) + " | chosen |",
             "|---|" + "---|" * len(protocol.LEARNING_RATES) + "---|"]
    for arm, row in selection.items():
        cells = [_number(row["scores"].get(lr), digits) for lr in protocol.LEARNING_RATES]
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {row['chosen'] or 'pending'} |")
    lines += ["", "Every arm at its learning rate (mean and t-based 95% interval over seeds; each seed's value; each "
              "seed's largest gradient norm before clipping to 1.0):", "",
              "| arm | lr | seeds | mean | 95% interval | per seed | largest gradient norm |",
              "|---|---|---|---|---|---|---|"]
    for variant, row in arms.items():
        per_seed = ", ".join(_number(v, digits) for v in row["values"])
        gradients = ", ".join(f"{g:.3g}" for g in row["largest_grad_norm"])
        lines.append(f"| {variant} | {row['lr']} | {len(row['seeds'])} | {_number(row['mean'], digits)} | "
                     f"[{_number(row['ci_low'], digits)}, {_number(row['ci_high'], digits)}] | {per_seed} | "
                     f"{gradients} |")
    lines += ["", "Paired comparisons (difference = variant - reference, paired by seed; Holm across every comparison "
              "reported in this file, both tasks):", "",
              "| variant | reference | pairs | mean difference | 95% interval | variant ahead | p | Holm p |",
              "|---|---|---|---|---|---|---|---|"]
    for row in found:
        lines.append(f"| {row['variant']} | {row['reference']} | {row['n']} | {row['mean_difference']:+.{digits}f} | "
                     f"[{row['ci_low']:+.{digits}f}, {row['ci_high']:+.{digits}f}] | "
                     f"{row['variant_ahead']} of {row['n']} | {_p(row['p_value'])} | {_p(row['holm_p'])} |")
    if gaps:
        what = "validation perplexity" if spec.curve_is_loss else "validation top-1 accuracy"
        lines += ["", f"Gap along training, paper_mix - {BASELINE}, {what} (paired, 95% interval):", "",
                  "| step | pairs | mean difference | 95% interval | p |", "|---|---|---|---|---|"]
        lines += [f"| {g['step']} | {g['n']} | {g['mean_difference']:+.{digits}f} | "
                  f"[{g['ci_low']:+.{digits}f}, {g['ci_high']:+.{digits}f}] | {_p(g['p_value'])} |" for g in gaps]
    return "\n".join(lines)


def plot_task(task, cells, arms, found, gaps, results_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = TASKS[task]
    colors = dict(zip(VARIANTS, ("tab:gray", "tab:red", "tab:blue", "tab:green")))
    ylabel = "validation perplexity" if spec.curve_is_loss else "validation top-1 accuracy"
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, runs in cells.items():
        series = [curve(runs[seed], task) for seed in sorted(runs)]
        steps = sorted(set.intersection(*(set(s) for s, _ in series)))
        by_step = [[dict(zip(s, v))[step] for s, v in series] for step in steps]
        bands = [paired_stats.mean_interval(values) for values in by_step]
        axes[0].plot(steps, [b[0] for b in bands], "o-", color=colors[variant], ms=3,
                     label=f"{variant} (lr {arms[variant]['lr']}, {len(runs)} seeds)")
        if len(runs) > 1:
            axes[0].fill_between(steps, [b[1] for b in bands], [b[2] for b in bands], color=colors[variant], alpha=0.15)
    axes[0].set(xlabel="step", ylabel=ylabel, yscale="log" if spec.curve_is_loss else "linear",
                title=f"{task}: mean over seeds, 95% band")
    if cells:
        axes[0].legend(fontsize=8)
    if gaps:
        steps = [g["step"] for g in gaps]
        axes[1].plot(steps, [g["mean_difference"] for g in gaps], "o-", color=colors["paper_mix"])
        axes[1].fill_between(steps, [g["ci_low"] for g in gaps], [g["ci_high"] for g in gaps],
                             color=colors["paper_mix"], alpha=0.2, label="95% interval")
        axes[1].axhline(0, color="grey", lw=0.8)
        axes[1].legend(fontsize=8)
    good = "below 0: paper_mix better" if not spec.higher_is_better else "above 0: paper_mix better"
    axes[1].set(xlabel="step", ylabel=f"paired difference in {ylabel}",
                title=f"{task}: paper_mix - {BASELINE} ({good})")
    paths.append(_save(fig, Path(results_dir) / f"{task}_learning_curves.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (variant, row) in enumerate(arms.items()):
        axes[0].scatter([i] * len(row["values"]), row["values"], color=colors[variant], s=18, zorder=3)
        if not math.isnan(row["ci_low"]):
            axes[0].errorbar([i + 0.15], [row["mean"]], yerr=[[row["mean"] - row["ci_low"]], [row["ci_high"] - row["mean"]]],
                             fmt="o", color="black", capsize=4)
    axes[0].set_xticks(range(len(arms)), list(arms), rotation=15)
    axes[0].set(ylabel=spec.primary, title=f"{task}: every seed, mean with 95% interval")
    for i, row in enumerate(found):
        axes[1].errorbar([row["mean_difference"]], [i], xerr=[[row["mean_difference"] - row["ci_low"]],
                                                            [row["ci_high"] - row["mean_difference"]]],
                         fmt="o", color="black", capsize=4)
        axes[1].scatter(row["differences"], [i] * row["n"], color=colors[row["variant"]], s=14, alpha=0.6)
    axes[1].axvline(0, color="grey", lw=0.8)
    axes[1].set_yticks(range(len(found)), [f"{r['variant']} - {r['reference']}\n(Holm p {_p(r['holm_p'])})" for r in found],
                       fontsize=8)
    axes[1].set(xlabel=f"paired difference in {spec.primary}", title="paired differences, 95% interval; dots: seeds")
    paths.append(_save(fig, Path(results_dir) / f"{task}_endpoints.png"))
    return paths


def _save(fig, path):
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_raw_runs(task, records, results_dir):
    folder = Path(results_dir) / "runs" / task
    folder.mkdir(parents=True, exist_ok=True)
    for record in records:
        name = f"{record['variant']}-lr{record['lr']}-seed{record['seed']}.json"
        (folder / name).write_text(json.dumps(record, indent=1))


def run_diagnostics(task, cells, runs_dir, results_dir):
    """The per-head diagnostics of every seed's final model, for every variant of the study: the markdown of
    their summary by p (diagnostics.json and the PNGs go to ``diagnostics/<task>/``)."""
    import diagnostics

    models = {f"{variant}/seed{seed}": Path(runs_dir) / task / variant / f"lr{record['lr']}-seed{seed}"
              for variant in VARIANTS if variant in cells for seed, record in sorted(cells[variant].items())}
    out_dir = Path(results_dir) / "diagnostics" / task
    diagnostics.run(models, TASKS[task].diagnostics_task, out_dir)
    report = json.loads((out_dir / "diagnostics.json").read_text())
    return diagnostics_markdown(task, diagnostics.summary_by_p(report["models"]))


DIAGNOSTIC_COLUMNS = {
    "energy_rate": "dJ/dtau / J, Euler direction",
    "step_energy_ratio": "J(MV) / J(V)",
    "max_offdiag_rowsum": "max off-diagonal row sum of A*P",
    "attention_hc_dc_gain": "HC/DC gain",
    "attention_hc_dc_gain_without_self_weight": "HC/DC gain, self pair's P = 1",
    "lambda_max_effective": "lambda_max(M)",
}


def diagnostics_markdown(task, summary):
    lines = [f"Per-head diagnostics of every seed's final model (`diagnostics/{task}/`; definitions in "
             "`experiments/diagnostics.py`): median [min, max] over layers, heads of that p and seeds.", "",
             "| variant | p | " + " | ".join(DIAGNOSTIC_COLUMNS.values()) + " |",
             "|---|---|" + "---|" * len(DIAGNOSTIC_COLUMNS)]
    for variant, by_p in summary.items():
        for p, metrics in by_p.items():
            cells = [f"{metrics[m][0]:.3g} [{metrics[m][1]:.3g}, {metrics[m][2]:.3g}]" for m in DIAGNOSTIC_COLUMNS]
            lines.append(f"| {variant} | {p:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize(runs_dir, results_dir, tasks=tuple(TASKS), with_diagnostics=False):
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    per_task = {}
    for task in tasks:
        records = read_records(runs_dir, task)
        if not records:
            continue
        cells = study_cells(records)
        per_task[task] = {"records": records, "cells": cells, "progress": progress(task, records),
                          "selection": selection_table(task, records),
                          "arms": arm_summary(task, cells), "comparisons": comparisons(task, cells),
                          "gaps": gap_along_training(task, cells)}
    family = [row for summary in per_task.values() for row in summary["comparisons"]]
    for row, adjusted in zip(family, paired_stats.holm([row["p_value"] for row in family])):
        row["holm_p"] = adjusted
    sections = ["# The p-LaT study", "",
                f"Generated by `experiments/summarize.py` from `{Path(runs_dir).name}`; protocol in "
                "`experiments/README.md`.", ""]
    for task, summary in per_task.items():
        write_raw_runs(task, summary["records"], results_dir)
        sections += [markdown(task, summary["progress"], summary["selection"], summary["arms"], summary["comparisons"],
                              summary["gaps"]), ""]
        if summary["cells"]:  # the learning-rate selection alone has no plots
            sections += [f"![{path.stem}]({path.name})"
                         for path in plot_task(task, summary["cells"], summary["arms"], summary["comparisons"],
                                               summary["gaps"], results_dir)]
            if with_diagnostics:
                sections += ["", run_diagnostics(task, summary["cells"], runs_dir, results_dir)]
        sections.append("")
    (results_dir / "study.md").write_text("\n".join(sections))
    numbers = {task: {k: v for k, v in summary.items() if k not in ("records", "cells")}
               for task, summary in per_task.items()}
    (results_dir / "study.json").write_text(json.dumps(numbers, indent=1, allow_nan=True))
    print(f"Summary in {results_dir / 'study.md'}")
    return numbers


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default=str(REPO / "runs" / "study"))
    parser.add_argument("--results_dir", default=str(REPO / "results"))
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--diagnostics", action="store_true", help="also the per-head diagnostics of every model")
    args = parser.parse_args(argv)
    summarize(args.runs_dir, args.results_dir, args.tasks, args.diagnostics)


if __name__ == "__main__":
    main()
