"""The study protocol, fixed before any run: tasks, budgets, recipes, arms, controls, seeds and endpoints.

Two main arms (softmax attention and the paper's 1.5 / 2.5 head mix) and two mechanism controls (the Euler
formulation, and the paper's formulation with a larger eps, which shrinks the p < 2 self-weight from 31.6 to
3.2). Per task and main arm the learning rate is chosen from ``LEARNING_RATES`` on the validation metric of
the selection seed alone; the comparison then uses fresh seeds, paired across arms (same initial weights,
same batches: p and eps change no parameter). The controls run at the learning rate chosen for the paper's
mix, so that they differ from it in the mechanism only. experiments/README.md states the same in prose.

The amendment of 2026-11-24, fixed before any of its cells ran, adds cells and a second family of tests and
leaves the original's cells, comparisons and Holm family as they were (``PARTS``: a task lists its original arms
and controls apart from the arms the amendment adds). On PTB, two arms complete a 2 x 2 factorial with
softmax and the paper's mix: self-weight (eq. 12's eps^((p - 2) / 2) on the self pair) x p-weighting (the
p-Laplacian weights of the other tokens). A new task, ``ptb_llama``, repeats softmax against the mix on the
Llama-shaped twin of the PTB model. The amendment's arms choose their own learning rates like the main arms and
run the main seeds; ``CONTRASTS`` are its tests, Holm-corrected among themselves.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

from plat_train.presets import resolve_config_name

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Task:
    script: str
    preset: str
    steps: int
    recipe: tuple  # flags shared by every cell of the task, learning rate and seed excepted
    primary: str  # the primary endpoint, a key of the script's all_results.json
    selection: str  # the validation metric that picks the learning rate
    higher_is_better: bool
    curve: str  # the validation metric logged at every evaluation during training
    curve_is_loss: bool  # a loss whose exp is the perplexity (PTB), else the metric itself
    diagnostics_task: str
    # The original protocol's main arms (each its own learning rate, MAIN_SEEDS) and controls (the learning rate
    # of their ``lr_from`` arm, CONTROL_SEEDS); and the arms the amendment adds (own learning rate, MAIN_SEEDS).
    arms: tuple = ("softmax", "paper_mix")
    controls: tuple = ("euler_mix", "paper_mix_eps1e-2")
    amendment_arms: tuple = ()


TASKS = {
    # The README's main job: about 2 epochs of PTB (227 steps of 32 x 128 tokens per epoch).
    "ptb": Task(
        script="run_clm.py", preset="plat-ptb-tiny", steps=450,
        recipe=("--per_device_train_batch_size", "32", "--per_device_eval_batch_size", "64",
                "--weight_decay", "0.01", "--warmup_steps", "20", "--lr_scheduler_type", "cosine",
                "--eval_strategy", "steps", "--eval_steps", "75", "--logging_steps", "25",
                "--eval_stride", "64", "--sliding_window_batch_size", "32"),
        primary="test_sliding_perplexity", selection="eval_sliding_perplexity", higher_is_better=False,
        curve="eval_loss", curve_is_loss=True, diagnostics_task="text",
        amendment_arms=("softmax_selfweight", "paper_mix_noself"),  # the factorial's other two arms
    ),
    # 4 epochs of the 54,000 training images left after the 10% validation hold-out (422 steps of 128).
    "fmnist": Task(
        script="run_image_classification.py", preset="plat-fmnist-tiny", steps=1688,
        recipe=("--per_device_train_batch_size", "128", "--per_device_eval_batch_size", "500",
                "--weight_decay", "0.05", "--warmup_steps", "0.05", "--lr_scheduler_type", "cosine",
                "--crop_scale_min", "0.6", "--eval_strategy", "steps", "--eval_steps", "211",
                "--logging_steps", "50"),
        primary="test_top1_accuracy", selection="eval_top1_accuracy", higher_is_better=True,
        curve="eval_top1_accuracy", curve_is_loss=False, diagnostics_task="image",
    ),
}
# The amendment's task: the Llama-shaped twin of the PTB model (rotary positions, RMSNorm, SwiGLU, 8 query heads over
# 4 key/value heads) with the PTB task's recipe and budget, softmax against the paper's mix, no controls.
TASKS["ptb_llama"] = replace(TASKS["ptb"], preset="plat-llama-tiny", arms=(), controls=(),
                             amendment_arms=("softmax", "paper_mix"))
PARTS = ("original", "amendment")


@dataclass(frozen=True)
class Variant:
    p: object  # one p for every head, or "mix": the paper's first ceil(H / 2) heads 1.5, the rest 2.5
    formulation: str = "paper"
    eps: float | None = None  # None: the preset's plap_eps (1e-6)
    lr_from: str | None = None  # a control takes the learning rate chosen for this arm


VARIANTS = {
    "softmax": Variant(p=2.0),
    "paper_mix": Variant(p="mix"),
    "euler_mix": Variant(p="mix", formulation="euler", lr_from="paper_mix"),
    "paper_mix_eps1e-2": Variant(p="mix", eps=1e-2, lr_from="paper_mix"),
    # The amendment's factorial arms. Softmax attention plus the mix's self-weights: P = 1 for the other tokens,
    # eps^((p - 2) / 2) on the self pair (31.6 for the p = 1.5 heads, 0.03 for the p = 2.5 heads).
    "softmax_selfweight": Variant(p="mix", formulation="selfweight"),
    # The mix's p-Laplacian weights of the other tokens, the self pair's P set to 1.
    "paper_mix_noself": Variant(p="mix", formulation="noself"),
}
BASELINE = "softmax"

LEARNING_RATES = ("1e-3", "3e-3")
SELECTION_SEED = 0
MAIN_SEEDS = (1, 2, 3, 4, 5, 6)
CONTROL_SEEDS = (1, 2, 3)

# (variant, reference): every comparison reported, Holm-corrected together across both tasks.
COMPARISONS = (
    ("paper_mix", "softmax"),
    ("euler_mix", "softmax"),
    ("paper_mix_eps1e-2", "softmax"),
    ("euler_mix", "paper_mix"),
    ("paper_mix_eps1e-2", "paper_mix"),
)


@dataclass(frozen=True)
class Contrast:
    """A test of the amendment: on each seed, the weighted sum of the variants' primary endpoints."""

    name: str
    task: str
    weights: tuple  # ((variant, weight), ...)
    question: str

    def variants(self):
        return [variant for variant, _ in self.weights]

    def value(self, results):
        """The contrast on one seed; ``results`` maps each variant to its primary endpoint on that seed."""
        return sum(weight * results[variant] for variant, weight in self.weights)

    def definition(self):
        """'0.5 paper_mix - 0.5 paper_mix_noself + ...': the weights as a reader checks them."""
        terms = [f"{'-' if weight < 0 else '+'} {'' if abs(weight) == 1 else f'{abs(weight):g} '}{variant}"
                 for variant, weight in self.weights]
        return " ".join(terms).removeprefix("+ ")


# The amendment's family, Holm-corrected among themselves (apart from COMPARISONS). The factorial's four arms share
# every seed's initial weights and batches, so each contrast is a one-sample question about its per-seed values.
CONTRASTS = (
    Contrast("self_weight", "ptb",
             (("paper_mix", 0.5), ("paper_mix_noself", -0.5), ("softmax_selfweight", 0.5), ("softmax", -0.5)),
             "main effect of eq. 12's self-weight: its mean effect with and without the p-weighting"),
    Contrast("p_weighting", "ptb",
             (("paper_mix", 0.5), ("softmax_selfweight", -0.5), ("paper_mix_noself", 0.5), ("softmax", -0.5)),
             "main effect of the p-Laplacian weighting of the other tokens, with and without the self-weight"),
    Contrast("interaction", "ptb",
             (("paper_mix", 1), ("paper_mix_noself", -1), ("softmax_selfweight", -1), ("softmax", 1)),
             "the self-weight's effect with the p-weighting minus its effect without"),
    Contrast("llama_paper_mix_vs_softmax", "ptb_llama", (("paper_mix", 1), ("softmax", -1)),
             "the paper's mix against softmax on the Llama-shaped model"),
)


def paper_p_mix(num_heads):
    """The paper's head mix, as ``modeling_plat.paper_p_mix`` (not imported: the protocol reads no model code)."""
    num_low = (num_heads + 1) // 2
    return [1.5] * num_low + [2.5] * (num_heads - num_low)


def preset_heads(task):
    """The head count of a task's preset, read from the preset file."""
    return json.loads(Path(resolve_config_name(task.preset)).read_text())["num_attention_heads"]


def variant_overrides(variant_name, num_heads):
    """The ``--config_overrides`` of a variant: p per head, the formulation and (controls) eps; nothing else."""
    variant = VARIANTS[variant_name]
    p = paper_p_mix(num_heads) if variant.p == "mix" else variant.p
    text = f"plap_p={json.dumps(p).replace(' ', '')},plap_formulation={variant.formulation}"
    return text if variant.eps is None else f"{text},plap_eps={variant.eps}"


@dataclass(frozen=True)
class Cell:
    task: str
    variant: str
    lr: str
    seed: int
    phase: str  # "selection", "main" or "control"

    def path(self, runs_dir):
        return Path(runs_dir) / self.task / self.variant / f"lr{self.lr}-seed{self.seed}"


def arms_of(task, part):
    """The arms of ``task`` that choose their own learning rate in ``part`` ("original" or "amendment")."""
    return TASKS[task].arms if part == "original" else TASKS[task].amendment_arms


def controls_of(task, part):
    return TASKS[task].controls if part == "original" else ()


def part_of(task, variant):
    """The part of the protocol that a variant's cells of ``task`` belong to, or None if it plans none."""
    return next((part for part in PARTS if variant in arms_of(task, part) + controls_of(task, part)), None)


def selection_cells(task, parts=PARTS):
    return [Cell(task, arm, lr, SELECTION_SEED, "selection")
            for part in parts for arm in arms_of(task, part) for lr in LEARNING_RATES]


def choose_learning_rate(task, arm, selection_results):
    """The learning rate whose selection-seed run has the best validation metric, or None while any is missing.

    ``selection_results`` maps a selection cell to its all_results.json (absent or None if not finished).
    """
    spec = TASKS[task]
    scores = {}
    for lr in LEARNING_RATES:
        results = selection_results.get(Cell(task, arm, lr, SELECTION_SEED, "selection"))
        if results is None:
            return None
        scores[lr] = results[spec.selection]
    pick = max if spec.higher_is_better else min
    return pick(scores, key=scores.get)


def planned_cells(selection_results, tasks=tuple(TASKS), parts=PARTS):
    """Every cell of the study, in run order; a cell whose learning rate is not chosen yet is None.

    Part by part (the original protocol, then its amendment): selection runs first; then seed by seed, for each
    task, the arms and (for the first control seeds) the controls, so that a study stopped part-way holds complete
    pairs for its first seeds.
    """
    cells = []
    for part in parts:
        cells += [cell for task in tasks for cell in selection_cells(task, (part,))]
        for seed in MAIN_SEEDS:
            for task in tasks:
                controls = controls_of(task, part)
                for name in arms_of(task, part) + controls:
                    if name in controls and seed not in CONTROL_SEEDS:
                        continue
                    lr = choose_learning_rate(task, VARIANTS[name].lr_from or name, selection_results)
                    cells.append(None if lr is None
                                 else Cell(task, name, lr, seed, "control" if name in controls else "main"))
    return cells
