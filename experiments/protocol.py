"""The study protocol, fixed before any run: tasks, budgets, recipes, arms, controls, seeds and endpoints.

Two main arms (softmax attention and the paper's 1.5 / 2.5 head mix) and two mechanism controls (the Euler
formulation, and the paper's formulation with a larger eps, which shrinks the p < 2 self-weight from 31.6 to
3.2). Per task and main arm the learning rate is chosen from ``LEARNING_RATES`` on the validation metric of
the selection seed alone; the comparison then uses fresh seeds, paired across arms (same initial weights,
same batches: p and eps change no parameter). The controls run at the learning rate chosen for the paper's
mix, so that they differ from it in the mechanism only. experiments/README.md states the same in prose.
"""

import json
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Variant:
    p: object  # one p for every head, or "mix": the paper's first ceil(H / 2) heads 1.5, the rest 2.5
    formulation: str = "paper"
    eps: float | None = None  # None: the preset's plap_eps (1e-6)
    lr_from: str | None = None  # a control takes the learning rate chosen for this arm


ARMS = {
    "softmax": Variant(p=2.0),
    "paper_mix": Variant(p="mix"),
}
CONTROLS = {
    "euler_mix": Variant(p="mix", formulation="euler", lr_from="paper_mix"),
    "paper_mix_eps1e-2": Variant(p="mix", eps=1e-2, lr_from="paper_mix"),
}
VARIANTS = {**ARMS, **CONTROLS}
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


def selection_cells(task):
    return [Cell(task, arm, lr, SELECTION_SEED, "selection") for arm in ARMS for lr in LEARNING_RATES]


def choose_learning_rate(task, arm, selection_results):
    """The learning rate whose selection-seed run has the best validation metric, or None while any is missing.

    ``selection_results`` maps a selection cell to its all_results.json (absent or None if not finished).
    """
    spec = TASKS[task]
    scores = {}
    for cell in selection_cells(task):
        if cell.variant != arm:
            continue
        results = selection_results.get(cell)
        if results is None:
            return None
        scores[cell.lr] = results[spec.selection]
    pick = max if spec.higher_is_better else min
    return pick(scores, key=scores.get)


def planned_cells(selection_results, tasks=tuple(TASKS)):
    """Every cell of the study, in run order; a cell whose learning rate is not chosen yet is None.

    Selection runs first; then seed by seed, for each task, the main arms and (for the first control seeds)
    the controls, so that a study stopped part-way holds complete pairs for its first seeds.
    """
    cells = [cell for task in tasks for cell in selection_cells(task)]
    for seed in MAIN_SEEDS:
        for task in tasks:
            for name, variant in VARIANTS.items():
                if name in CONTROLS and seed not in CONTROL_SEEDS:
                    continue
                lr = choose_learning_rate(task, variant.lr_from or name, selection_results)
                cells.append(None if lr is None else Cell(task, name, lr, seed, "control" if name in CONTROLS else "main"))
    return cells
