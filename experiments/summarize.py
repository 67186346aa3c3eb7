#!/usr/bin/env python
"""Summarise the study of experiments/protocol.py from the runs folder that run_grid.py fills.

    python experiments/summarize.py --runs_dir runs/study --results_dir results

Writes into ``--results_dir``: ``study.md`` (the learning-rate selection, every arm's primary endpoint with a
95% interval, each comparison's paired difference with its interval, sign count, p-value and Holm-adjusted
p-value, the gap at fixed points of training), ``study.json`` (the same numbers), ``runs/<task>/`` (each run's
record with its whole training log) and PNGs: learning curves with bands and the paired gap along training,
and every seed's endpoint per arm. The amendment of 2026-11-24 has a section of its own (its arms, its contrasts
with their per-seed values and their own Holm correction, its plots); the original protocol's sections and their
Holm family of ten comparisons read only the original's cells. ``--diagnostics`` adds the per-head diagnostics of
experiments/diagnostics.py on every seed's final model (``--diagnostics amendment``: the amendment's models only);
a section whose models are not measured keeps the table of the diagnostics.json an earlier summary left.
"""

import argparse
import collections
import json
import math
from pathlib import Path

import paired_stats
import protocol
from protocol import BASELINE, COMPARISONS, CONTRASTS, TASKS, VARIANTS

REPO = protocol.REPO
COLORS = dict(zip(VARIANTS, ("tab:gray", "tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")))

# Not tests of the protocol: where the factorial's interaction is large its main effects average two different
# effects, so the summary also shows each factor's effect at either level of the other. Exploratory, outside the
# Holm family, and reported with unadjusted p-values.
SIMPLE_EFFECTS = (
    protocol.Contrast("self_weight_alone", "ptb", (("softmax_selfweight", 1), ("softmax", -1)),
                      "the self-weight added to softmax attention"),
    protocol.Contrast("self_weight_with_p_weighting", "ptb", (("paper_mix", 1), ("paper_mix_noself", -1)),
                      "the self-weight added to the p-Laplacian weighting (eq. 12 against its self-weight-free form)"),
    protocol.Contrast("p_weighting_alone", "ptb", (("paper_mix_noself", 1), ("softmax", -1)),
                      "the p-Laplacian weighting of the other tokens added to softmax attention"),
    protocol.Contrast("p_weighting_with_self_weight", "ptb", (("paper_mix", 1), ("softmax_selfweight", -1)),
                      "the p-Laplacian weighting added to the self-weighted softmax (eq. 12 against the self-weight "
                      "alone)"),
)


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


def part_records(task, records, part):
    """The records of ``task`` whose cells belong to ``part`` of the protocol."""
    return [record for record in records if protocol.part_of(task, record["variant"]) == part]


def selection_table(task, records, part="original"):
    """Per arm of ``part``: the selection metric of each learning rate at the selection seed, and the one chosen."""
    spec = TASKS[task]
    results = selection_results(task, records)
    return {arm: {"scores": {cell.lr: results[cell][spec.selection] for cell in protocol.selection_cells(task, (part,))
                             if cell.variant == arm and cell in results},
                  "chosen": protocol.choose_learning_rate(task, arm, results)}
            for arm in protocol.arms_of(task, part)}


def curve(record, task):
    """(steps, values) of the validation curve: perplexity for PTB, top-1 accuracy for Fashion-MNIST."""
    spec = TASKS[task]
    points = {entry["step"]: entry[spec.curve] for entry in record["log_history"] if spec.curve in entry}
    steps = sorted(points)
    values = [math.exp(points[s]) if spec.curve_is_loss else points[s] for s in steps]
    return steps, values


def progress(task, records, part="original"):
    """How much of the plan of ``part`` for ``task`` has finished: counts and the names of the missing cells."""
    finished = {(record["variant"], record["lr"], record["seed"]) for record in records}
    planned = protocol.planned_cells(selection_results(task, records), (task,), (part,))
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


def contrasts(task, cells, family=CONTRASTS):
    """Each contrast of ``family`` on ``task`` over the seeds that every one of its arms has (none below 2)."""
    spec = TASKS[task]
    found = []
    for contrast in family:
        if contrast.task != task:
            continue
        seeds = sorted(set.intersection(*(set(cells.get(variant, {})) for variant in contrast.variants())))
        if len(seeds) < 2:
            continue
        values = [contrast.value({variant: cells[variant][seed]["results"][spec.primary]
                                  for variant in contrast.variants()}) for seed in seeds]
        found.append({"name": contrast.name, "task": task, "definition": contrast.definition(),
                      "question": contrast.question, "metric": spec.primary, "seeds": seeds, "values": values,
                      **paired_stats.one_sample(values)})
    return found


def amendment_variants(task):
    """The variants of the amendment's tables for ``task``: its arms and those its contrasts weigh (VARIANTS order)."""
    named = set(TASKS[task].amendment_arms).union(*(c.variants() for c in CONTRASTS if c.task == task))
    return [variant for variant in VARIANTS if variant in named]


def amendment_summary(records_by_task):
    """The amendment's numbers on the tasks it adds arms to, or None while none of its cells has finished.

    Its contrasts read every main cell of a task (on PTB the original softmax and paper_mix cells too) and are
    Holm-corrected among themselves.
    """
    tasks = [task for task in records_by_task if TASKS[task].amendment_arms]
    if not any(part_records(task, records_by_task[task], "amendment") for task in tasks):
        return None
    summary = {"tasks": tasks, "progress": {"planned": 0, "finished": 0, "missing": []}, "selection": {}, "arms": {},
               "contrasts": [], "simple_effects": [], "gaps": {}}
    for task in tasks:
        records = records_by_task[task]
        cells = study_cells(records)
        done = progress(task, records, "amendment")
        summary["progress"]["planned"] += done["planned"]
        summary["progress"]["finished"] += done["finished"]
        summary["progress"]["missing"] += [f"{task}/{name}" if "/" in name else f"{name} ({task})"
                                           for name in done["missing"]]
        summary["selection"][task] = selection_table(task, records, "amendment")
        summary["arms"][task] = arm_summary(task, {v: cells[v] for v in amendment_variants(task) if v in cells})
        summary["contrasts"] += contrasts(task, cells)
        summary["simple_effects"] += contrasts(task, cells, SIMPLE_EFFECTS)
        if protocol.part_of(task, BASELINE) == "amendment":  # a task of the amendment's own: the gap along training
            summary["gaps"][task] = gap_along_training(task, cells)
    for row, adjusted in zip(summary["contrasts"], paired_stats.holm([row["p_value"] for row in summary["contrasts"]])):
        row["holm_p"] = adjusted
    return summary


# --- Report ----------------------------------------------------------------------------------------------


def _p(value):
    """A p-value as a reader compares it with 0.05: three decimals, or two significant digits below 0.001."""
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}"


def _number(value, digits):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _digits(task):
    return 4 if TASKS[task].higher_is_better else 1


def progress_line(done, what="the protocol"):
    if not done["missing"]:
        return f"All {done['planned']} cells of {what} finished."
    return (f"**Incomplete: {done['finished']} of {done['planned']} cells finished.** The intervals and p-values "
            f"below come from the finished cells only and will move as the rest finish. Missing: "
            + ", ".join(f"`{name}`" if count == 1 else f"{count} x `{name}`"
                        for name, count in collections.Counter(done["missing"]).items()) + ".")


def selection_rows(selection, digits, first=()):
    """Rows of the learning-rate table: ``first`` cells, the arm, its metric at each learning rate, the choice."""
    return ["| " + "".join(f"{cell} | " for cell in first) + f"{arm} | "
            + " | ".join(_number(row["scores"].get(lr), digits) for lr in protocol.LEARNING_RATES)
            + f" | {row['chosen'] or 'pending'} |" for arm, row in selection.items()]


def arm_rows(arms, digits, first=()):
    """Rows of the arms table: ``first`` cells, then lr, seeds, mean, interval, per seed, largest gradient norms."""
    rows = []
    for variant, row in arms.items():
        per_seed = ", ".join(_number(v, digits) for v in row["values"])
        gradients = ", ".join(f"{g:.3g}" for g in row["largest_grad_norm"])
        rows.append("| " + "".join(f"{cell} | " for cell in first) + f"{variant} | {row['lr']} | {len(row['seeds'])} | "
                    f"{_number(row['mean'], digits)} | [{_number(row['ci_low'], digits)}, "
                    f"{_number(row['ci_high'], digits)}] | {per_seed} | {gradients} |")
    return rows


def gap_lines(task, gaps):
    spec, digits = TASKS[task], _digits(task)
    what = "validation perplexity" if spec.curve_is_loss else "validation top-1 accuracy"
    return ([f"Gap along training, paper_mix - {BASELINE}, {what} (paired, 95% interval):", "",
             "| step | pairs | mean difference | 95% interval | p |", "|---|---|---|---|---|"]
            + [f"| {g['step']} | {g['n']} | {g['mean_difference']:+.{digits}f} | "
               f"[{g['ci_low']:+.{digits}f}, {g['ci_high']:+.{digits}f}] | {_p(g['p_value'])} |" for g in gaps])


def markdown(task, done, selection, arms, found, gaps):
    spec = TASKS[task]
    digits = _digits(task)
    better = "higher" if spec.higher_is_better else "lower"
    lines = [f"## {task}: `{spec.preset}`, {spec.steps} steps, `{spec.script}`", "", progress_line(done), "",
             f"Primary endpoint `{spec.primary}` ({better} is better).", "",
             f"Learning rate chosen on `{spec.selection}` at seed {protocol.SELECTION_SEED}:", "",
             "| arm | " + " | ".join(f"lr {lr}" for lr in protocol.LEARNING_RATES) + " | chosen |",
             "|---|" + "---|" * len(protocol.LEARNING_RATES) + "---|"]
    lines += selection_rows(selection, digits)
    lines += ["", "Every arm at its learning rate (mean and t-based 95% interval over seeds; each seed's value; each "
              "seed's largest gradient norm before clipping to 1.0):", "",
              "| arm | lr | seeds | mean | 95% interval | per seed | largest gradient norm |",
              "|---|---|---|---|---|---|---|"]
    lines += arm_rows(arms, digits)
    lines += ["", "Paired comparisons (difference = variant - reference, paired by seed; Holm across every comparison "
              "reported in this file, both tasks):", "",
              "| variant | reference | pairs | mean difference | 95% interval | variant ahead | p | Holm p |",
              "|---|---|---|---|---|---|---|---|"]
    for row in found:
        lines.append(f"| {row['variant']} | {row['reference']} | {row['n']} | {row['mean_difference']:+.{digits}f} | "
                     f"[{row['ci_low']:+.{digits}f}, {row['ci_high']:+.{digits}f}] | "
                     f"{row['variant_ahead']} of {row['n']} | {_p(row['p_value'])} | {_p(row['holm_p'])} |")
    if gaps:
        lines += [""] + gap_lines(task, gaps)
    return "\n".join(lines)


def contrast_row(row, holm):
    """A contrast's table row: definition, mean with its interval, sign count, p (and Holm p), per-seed values."""
    digits = _digits(row["task"])
    per_seed = ", ".join(f"{seed}: {value:+.{digits}f}" for seed, value in zip(row["seeds"], row["values"]))
    return (f"| {row['name']} | {row['task']} | {row['definition']} | {row['n']} | {row['mean']:+.{digits}f} | "
            f"[{row['ci_low']:+.{digits}f}, {row['ci_high']:+.{digits}f}] | {row['negative']} / {row['positive']} | "
            f"{_p(row['p_value'])} | " + (f"{_p(row['holm_p'])} | " if holm else "") + f"{per_seed} |")


def amendment_markdown(summary):
    tasks = summary["tasks"]
    lines = ["## Amendment (2026-11-24): self-weight x p-weighting on PTB, and the Llama-shaped twin", "",
             progress_line(summary["progress"], "the amendment"), "",
             "Primary endpoints as in the tasks above: " + "; ".join(
                 f"{task} `{TASKS[task].primary}` ({'higher' if TASKS[task].higher_is_better else 'lower'} is "
                 f"better), `{TASKS[task].preset}`, {TASKS[task].steps} steps" for task in tasks) + ".", "",
             (f"Learning rate of each arm the amendment adds, chosen at seed {protocol.SELECTION_SEED} on the "
              "validation metric of the task above (the original arms keep theirs):"), "",
             "| task | arm | " + " | ".join(f"lr {lr}" for lr in protocol.LEARNING_RATES) + " | chosen |",
             "|---|---|" + "---|" * len(protocol.LEARNING_RATES) + "---|"]
    for task in tasks:
        lines += selection_rows(summary["selection"][task], _digits(task), first=(task,))
    lines += ["", ("Every arm that the amendment's contrasts weigh, at its learning rate (mean and t-based 95% "
                   "interval over seeds; each seed's value; each seed's largest gradient norm before clipping to "
                   "1.0):"), "",
              "| task | arm | lr | seeds | mean | 95% interval | per seed | largest gradient norm |",
              "|---|---|---|---|---|---|---|---|"]
    for task in tasks:
        lines += arm_rows(summary["arms"][task], _digits(task), first=(task,))
    lines += ["", ("Contrasts (on each seed the weighted sum of the arms' primary endpoints, the seeds pairing the "
                   "arms; t-based 95% interval; how many seeds fall below and above 0; Holm across the amendment's "
                   "contrasts only, apart from the comparisons above):"), "",
              ("| contrast | task | definition | seeds | mean | 95% interval | below / above 0 | p | Holm p "
               "| per seed |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [contrast_row(row, holm=True) for row in summary["contrasts"]]
    lines += ["", "What each contrast asks:", ""]
    lines += [f"- `{contrast.name}` ({contrast.task}): {contrast.question}." for contrast in CONTRASTS]
    if summary["simple_effects"]:
        lines += ["", ("Simple effects of the factorial: each factor at either level of the other, on the same "
                       "seeds. Exploratory, not among the amendment's tests: no Holm correction, and a p-value here "
                       "decides nothing."), "",
                  "| effect | task | definition | seeds | mean | 95% interval | below / above 0 | p | per seed |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [contrast_row(row, holm=False) for row in summary["simple_effects"]]
        lines += [""] + [f"- `{effect.name}` ({effect.task}): {effect.question}." for effect in SIMPLE_EFFECTS]
    for task, gaps in summary["gaps"].items():
        if gaps:
            lines += ["", f"{task}: " + gap_lines(task, gaps)[0]] + gap_lines(task, gaps)[1:]
    return "\n".join(lines)


def draw_curves(ax, task, cells, arms):
    """Each variant's validation curve, mean over seeds with its 95% band, on ``ax``."""
    spec = TASKS[task]
    for variant, runs in cells.items():
        series = [curve(runs[seed], task) for seed in sorted(runs)]
        steps = sorted(set.intersection(*(set(s) for s, _ in series)))
        by_step = [[dict(zip(s, v))[step] for s, v in series] for step in steps]
        bands = [paired_stats.mean_interval(values) for values in by_step]
        ax.plot(steps, [b[0] for b in bands], "o-", color=COLORS[variant], ms=3,
                label=f"{variant} (lr {arms[variant]['lr']}, {len(runs)} seeds)")
        if len(runs) > 1:
            ax.fill_between(steps, [b[1] for b in bands], [b[2] for b in bands], color=COLORS[variant], alpha=0.15)
    ax.set(xlabel="step", ylabel="validation perplexity" if spec.curve_is_loss else "validation top-1 accuracy",
           yscale="log" if spec.curve_is_loss else "linear", title=f"{task}: mean over seeds, 95% band")
    if cells:
        ax.legend(fontsize=8)


def plot_task(task, cells, arms, found, gaps, results_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = TASKS[task]
    ylabel = "validation perplexity" if spec.curve_is_loss else "validation top-1 accuracy"
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    draw_curves(axes[0], task, cells, arms)
    if gaps:
        steps = [g["step"] for g in gaps]
        axes[1].plot(steps, [g["mean_difference"] for g in gaps], "o-", color=COLORS["paper_mix"])
        axes[1].fill_between(steps, [g["ci_low"] for g in gaps], [g["ci_high"] for g in gaps],
                             color=COLORS["paper_mix"], alpha=0.2, label="95% interval")
        axes[1].axhline(0, color="grey", lw=0.8)
        axes[1].legend(fontsize=8)
    good = "below 0: paper_mix better" if not spec.higher_is_better else "above 0: paper_mix better"
    axes[1].set(xlabel="step", ylabel=f"paired difference in {ylabel}",
                title=f"{task}: paper_mix - {BASELINE} ({good})")
    paths.append(_save(fig, Path(results_dir) / f"{task}_learning_curves.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (variant, row) in enumerate(arms.items()):
        axes[0].scatter([i] * len(row["values"]), row["values"], color=COLORS[variant], s=18, zorder=3)
        if not math.isnan(row["ci_low"]):
            axes[0].errorbar([i + 0.15], [row["mean"]], yerr=[[row["mean"] - row["ci_low"]], [row["ci_high"] - row["mean"]]],
                             fmt="o", color="black", capsize=4)
    axes[0].set_xticks(range(len(arms)), list(arms), rotation=15)
    axes[0].set(ylabel=spec.primary, title=f"{task}: every seed, mean with 95% interval")
    for i, row in enumerate(found):
        axes[1].errorbar([row["mean_difference"]], [i], xerr=[[row["mean_difference"] - row["ci_low"]],
                                                            [row["ci_high"] - row["mean_difference"]]],
                         fmt="o", color="black", capsize=4)
        axes[1].scatter(row["differences"], [i] * row["n"], color=COLORS[row["variant"]], s=14, alpha=0.6)
    axes[1].axvline(0, color="grey", lw=0.8)
    axes[1].set_yticks(range(len(found)), [f"{r['variant']} - {r['reference']}\n(Holm p {_p(r['holm_p'])})" for r in found],
                       fontsize=8)
    axes[1].set(xlabel=f"paired difference in {spec.primary}", title="paired differences, 95% interval; dots: seeds")
    paths.append(_save(fig, Path(results_dir) / f"{task}_endpoints.png"))
    return paths


def plot_amendment(summary, cells_by_task, results_dir):
    """The amendment's two PNGs: its tasks' validation curves, and each contrast's seeds with its mean and interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = summary["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        cells = {v: cells_by_task[task][v] for v in summary["arms"][task]}
        draw_curves(ax, task, cells, summary["arms"][task])
    paths = [_save(fig, Path(results_dir) / "amendment_learning_curves.png")]

    # The tests on top, then the exploratory simple effects in grey (top to bottom as in study.md).
    rows = [(row, f"Holm p {_p(row['holm_p'])}", "black") for row in summary["contrasts"]]
    rows += [(row, f"exploratory, p {_p(row['p_value'])}", "tab:gray") for row in summary["simple_effects"]]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.75 * max(len(rows), 1)))
    for i, (row, _, color) in enumerate(rows):
        y = len(rows) - 1 - i
        ax.errorbar([row["mean"]], [y], xerr=[[row["mean"] - row["ci_low"]], [row["ci_high"] - row["mean"]]],
                    fmt="o", color=color, capsize=4)
        ax.scatter(row["values"], [y] * row["n"], color="tab:red", s=14, alpha=0.6)
    ax.axvline(0, color="grey", lw=0.8)
    if summary["simple_effects"]:
        ax.axhline(len(summary["simple_effects"]) - 0.5, color="grey", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows))[::-1], [f"{row['name']} ({row['task']})\n({note})" for row, note, _ in rows],
                  fontsize=8)
    metrics = sorted({TASKS[task].primary for task in tasks})
    ax.set(xlabel=f"contrast in {', '.join(metrics)}", title="amendment's contrasts, 95% interval; dots: seeds")
    paths.append(_save(fig, Path(results_dir) / "amendment_contrasts.png"))
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


def final_models(task, cells, runs_dir):
    """{``variant/seedK``: the folder of that cell's final model} for every cell of ``cells``."""
    return {f"{variant}/seed{seed}": Path(runs_dir) / task / variant / f"lr{record['lr']}-seed{seed}"
            for variant in VARIANTS if variant in cells for seed, record in sorted(cells[variant].items())}


def diagnostics_section(task, models, folder, results_dir, measure):
    """The markdown of the per-head diagnostics of ``models`` (summary by p), whose diagnostics.json and PNGs are in
    ``results_dir / folder``: measured now when ``measure``, else read from the diagnostics.json an earlier summary
    left there; None when there is none."""
    out_dir = Path(results_dir) / folder
    if not measure and not (out_dir / "diagnostics.json").is_file():
        return None
    import diagnostics

    if measure:
        diagnostics.run(models, TASKS[task].diagnostics_task, out_dir)
    report = json.loads((out_dir / "diagnostics.json").read_text())
    return diagnostics_markdown(folder, diagnostics.summary_by_p(report["models"]))


DIAGNOSTIC_COLUMNS = {
    "energy_rate": "dJ/dtau / J, Euler direction",
    "step_energy_ratio": "J(MV) / J(V)",
    "max_offdiag_rowsum": "max off-diagonal row sum of A*P",
    "attention_hc_dc_gain": "HC/DC gain",
    "attention_hc_dc_gain_without_self_weight": "HC/DC gain, self pair's P = 1",
    "lambda_max_effective": "lambda_max(M)",
}


def diagnostics_markdown(folder, summary):
    lines = [f"Per-head diagnostics of every seed's final model (`{folder}/`; definitions in "
             "`experiments/diagnostics.py`): median [min, max] over layers, heads of that p and seeds.", "",
             "| variant | p | " + " | ".join(DIAGNOSTIC_COLUMNS.values()) + " |",
             "|---|---|" + "---|" * len(DIAGNOSTIC_COLUMNS)]
    for variant, by_p in summary.items():
        for p, metrics in by_p.items():
            cells = [f"{metrics[m][0]:.3g} [{metrics[m][1]:.3g}, {metrics[m][2]:.3g}]" for m in DIAGNOSTIC_COLUMNS]
            lines.append(f"| {variant} | {p:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize(runs_dir, results_dir, tasks=tuple(TASKS), diagnostics_parts=()):
    """Write the summary of ``runs_dir`` into ``results_dir``; ``diagnostics_parts``: the parts of the protocol
    whose final models are measured now. Returns the numbers of study.json."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    records_by_task = {task: read_records(runs_dir, task) for task in tasks}
    per_task = {}
    for task, records in records_by_task.items():
        records = part_records(task, records, "original")
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
    amendment = amendment_summary(records_by_task)

    for task, records in records_by_task.items():
        if records:
            write_raw_runs(task, records, results_dir)
    sections = ["# The p-LaT study", "",
                f"Generated by `experiments/summarize.py` from `{Path(runs_dir).name}`; protocol in "
                "`experiments/README.md`.", ""]
    for task, summary in per_task.items():
        sections += [markdown(task, summary["progress"], summary["selection"], summary["arms"], summary["comparisons"],
                              summary["gaps"]), ""]
        if summary["cells"]:  # the learning-rate selection alone has no plots
            sections += [f"![{path.stem}]({path.name})"
                         for path in plot_task(task, summary["cells"], summary["arms"], summary["comparisons"],
                                               summary["gaps"], results_dir)]
            table = diagnostics_section(task, final_models(task, summary["cells"], runs_dir), f"diagnostics/{task}",
                                        results_dir, "original" in diagnostics_parts)
            if table is not None:
                sections += ["", table]
        sections.append("")
    if amendment is not None:
        sections += [amendment_markdown(amendment), ""]
        cells_by_task = {task: study_cells(records_by_task[task]) for task in amendment["tasks"]}
        if any(amendment["arms"].values()):
            sections += [f"![{path.stem}]({path.name})"
                         for path in plot_amendment(amendment, cells_by_task, results_dir)]
        for task in amendment["tasks"]:
            cells = study_cells(part_records(task, records_by_task[task], "amendment"))
            table = diagnostics_section(task, final_models(task, cells, runs_dir), f"diagnostics/amendment/{task}",
                                        results_dir, bool(cells) and "amendment" in diagnostics_parts)
            if table is not None:
                sections += ["", f"{task}, the amendment's arms. " + table]
        sections.append("")
    (results_dir / "study.md").write_text("\n".join(sections))
    numbers = {task: {k: v for k, v in summary.items() if k not in ("records", "cells")}
               for task, summary in per_task.items()}
    if amendment is not None:
        numbers["amendment"] = amendment
    (results_dir / "study.json").write_text(json.dumps(numbers, indent=1, allow_nan=True))
    print(f"Summary in {results_dir / 'study.md'}")
    return numbers


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs_dir", default=str(REPO / "runs" / "study"))
    parser.add_argument("--results_dir", default=str(REPO / "results"))
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--diagnostics", nargs="*", choices=protocol.PARTS, default=None, metavar="PART",
                        help="also the per-head diagnostics of every model (of these parts of the protocol: "
                             f"{', '.join(protocol.PARTS)}; all without a name)")
    args = parser.parse_args(argv)
    parts = () if args.diagnostics is None else (args.diagnostics or protocol.PARTS)
    summarize(args.runs_dir, args.results_dir, args.tasks, parts)


if __name__ == "__main__":
    main()
