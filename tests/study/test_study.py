"""The study's bookkeeping: the protocol's cells and learning-rate choice, the runner's commands and claims, and
the summary's numbers and files (on fake finished cells); the original protocol against its published records,
and the amendment's cells, commands and contrasts."""

import json
import math
import os
import shlex
import shutil

import paired_stats
import protocol
import pytest
import run_grid
import summarize
from protocol import Cell

PTB = protocol.TASKS["ptb"]
# Validation (selection) and test (primary) perplexity of the fake selection runs, per arm and learning rate.
SELECTION = {("softmax", "1e-3"): 300.0, ("softmax", "3e-3"): 280.0, ("paper_mix", "1e-3"): 270.0,
             ("paper_mix", "3e-3"): 290.0}
# Primary endpoint per main/control seed.
PRIMARY = {"softmax": [250.0, 260.0, 255.0, 270.0, 240.0, 265.0], "paper_mix": [245.0, 262.0, 250.0, 260.0, 238.0, 255.0],
           "euler_mix": [249.0, 258.0, 256.0], "paper_mix_eps1e-2": [251.0, 259.0, 254.0]}


def fake_cell(runs_dir, cell, primary, selection=None):
    """A finished cell as run_cell leaves it: cell.json and the trainer_state.json the summary reads."""
    spec = protocol.TASKS[cell.task]  # a PTB task
    folder = cell.path(runs_dir)
    folder.mkdir(parents=True)
    # Validation loss along training: the curve ends at the primary endpoint's log.
    history = [{"step": step, "eval_loss": math.log(primary) + (spec.steps - step) / 1000} for step in range(75, 451, 75)]
    # Training log entries with a gradient norm that peaks at the seed's number.
    history += [{"step": step, "loss": 5.0, "grad_norm": cell.seed * step / 450} for step in (25, 450, 300)]
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    results = {spec.primary: primary, spec.selection: selection if selection is not None else primary + 10}
    record = {"task": cell.task, "variant": cell.variant, "lr": cell.lr, "seed": cell.seed, "phase": cell.phase,
              "command": run_grid.shown(shlex.join(run_grid.cell_command(cell, runs_dir))), "results": results}
    (folder / "cell.json").write_text(json.dumps(record))


@pytest.fixture
def finished_study(tmp_path):
    runs_dir = tmp_path / "runs"
    for (arm, lr), value in SELECTION.items():
        fake_cell(runs_dir, Cell("ptb", arm, lr, 0, "selection"), value + 5, selection=value)
    plan = protocol.planned_cells(run_grid.selection_results(runs_dir, ["ptb"]), ["ptb"], ["original"])
    for cell in plan[4:]:
        fake_cell(runs_dir, cell, PRIMARY[cell.variant][cell.seed - 1])
    return runs_dir


def test_learning_rate_is_chosen_per_arm_on_the_selection_seed(finished_study):
    results = run_grid.selection_results(finished_study, ["ptb"])
    assert protocol.choose_learning_rate("ptb", "softmax", results) == "3e-3"
    assert protocol.choose_learning_rate("ptb", "paper_mix", results) == "1e-3"
    assert protocol.choose_learning_rate("ptb", "softmax", {}) is None


def test_plan_waits_for_the_selection_then_pairs_seeds(finished_study):
    pending = protocol.planned_cells({}, ["ptb"], ["original"])
    assert pending[:4] == protocol.selection_cells("ptb", ["original"]) and all(c is None for c in pending[4:])
    plan = protocol.planned_cells(run_grid.selection_results(finished_study, ["ptb"]), ["ptb"], ["original"])[4:]
    by_variant = {v: [c for c in plan if c.variant == v] for v in PTB.arms + PTB.controls}
    assert [c.seed for c in by_variant["softmax"]] == list(protocol.MAIN_SEEDS)
    assert {c.lr for c in by_variant["softmax"]} == {"3e-3"} and {c.lr for c in by_variant["paper_mix"]} == {"1e-3"}
    # The controls run at the learning rate chosen for the paper's mix, on the first seeds.
    for control in PTB.controls:
        assert [(c.seed, c.lr, c.phase) for c in by_variant[control]] == [(s, "1e-3", "control") for s in protocol.CONTROL_SEEDS]


def test_variant_overrides_change_only_p_formulation_and_eps():
    assert protocol.variant_overrides("softmax", 8) == "plap_p=2.0,plap_formulation=paper"
    assert protocol.variant_overrides("paper_mix", 3) == "plap_p=[1.5,1.5,2.5],plap_formulation=paper"
    assert protocol.variant_overrides("euler_mix", 3) == "plap_p=[1.5,1.5,2.5],plap_formulation=euler"
    assert protocol.variant_overrides("paper_mix_eps1e-2", 3) == "plap_p=[1.5,1.5,2.5],plap_formulation=paper,plap_eps=0.01"


def test_cell_commands_are_the_protocol_and_read_as_a_reader_runs_them(tmp_path):
    cell = Cell("fmnist", "paper_mix_eps1e-2", "1e-3", 2, "control")
    command = run_grid.shown(shlex.join(run_grid.cell_command(cell, run_grid.REPO / "runs" / "study")))
    assert command.startswith("python run_image_classification.py --config_name plat-fmnist-tiny ")
    assert "--output_dir runs/study/fmnist/paper_mix_eps1e-2/lr1e-3-seed2" in command
    for flag in ("--max_steps 1688", "--learning_rate 1e-3", "--seed 2", "plap_eps=0.01", "--eval_steps 211"):
        assert flag in command
    assert run_grid.parse_cell("fmnist/paper_mix_eps1e-2/lr1e-3-seed2") == cell


def test_claims_keep_two_runners_apart_and_dead_claims_are_taken_over(tmp_path):
    cell = Cell("ptb", "softmax", "1e-3", 0, "selection")
    assert run_grid.try_claim(cell, tmp_path)
    assert not run_grid.try_claim(cell, tmp_path)  # held by a live process (this one)
    claim = run_grid._claim_path(cell, tmp_path)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    claim.write_text(json.dumps({"pid": dead, "host": run_grid.socket.gethostname()}))
    assert run_grid.try_claim(cell, tmp_path)
    run_grid.release(cell, tmp_path)
    assert not claim.exists()


def test_summary_numbers_are_the_paired_statistics(finished_study, tmp_path):
    numbers = summarize.summarize(finished_study, tmp_path / "results", tasks=["ptb"])["ptb"]
    assert numbers["selection"]["softmax"] == {"scores": {"1e-3": 300.0, "3e-3": 280.0}, "chosen": "3e-3"}
    main = paired_stats.paired_comparison(PRIMARY["paper_mix"], PRIMARY["softmax"])
    row = next(r for r in numbers["comparisons"] if (r["variant"], r["reference"]) == ("paper_mix", "softmax"))
    for key in ("mean_difference", "ci_low", "ci_high", "p_value"):
        assert row[key] == pytest.approx(main[key])
    assert row["variant_ahead"] == 5 and row["n"] == 6  # lower perplexity is better: all seeds but the second
    control = next(r for r in numbers["comparisons"] if (r["variant"], r["reference"]) == ("euler_mix", "softmax"))
    assert control["seeds"] == [1, 2, 3]
    family = [r["p_value"] for r in numbers["comparisons"]]
    assert [r["holm_p"] for r in numbers["comparisons"]] == pytest.approx(paired_stats.holm(family))
    assert numbers["arms"]["softmax"]["largest_grad_norm"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [g["step"] for g in numbers["gaps"]] == list(range(75, 451, 75))
    assert numbers["gaps"][-1]["mean_difference"] == pytest.approx(main["mean_difference"])


def test_summary_writes_tables_raw_runs_and_plots(finished_study, tmp_path):
    results_dir = tmp_path / "results"
    summarize.main(["--runs_dir", str(finished_study), "--results_dir", str(results_dir), "--tasks", "ptb"])
    table = (results_dir / "study.md").read_text()
    assert "| paper_mix | softmax | 6 |" in table and "| softmax | 3e-3 | 6 |" in table
    assert "beyond" not in table.lower()
    raw = json.loads((results_dir / "runs" / "ptb" / "paper_mix-lr1e-3-seed4.json").read_text())
    assert raw["results"][PTB.primary] == PRIMARY["paper_mix"][3] and raw["log_history"]
    assert raw["command"].startswith("python run_clm.py --config_name plat-ptb-tiny")
    for name in ("ptb_learning_curves.png", "ptb_endpoints.png"):
        assert (results_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({name})" in table


def test_a_partial_study_says_what_is_missing(finished_study, tmp_path):
    (finished_study / "ptb" / "paper_mix" / "lr1e-3-seed6" / "cell.json").unlink()
    numbers = summarize.summarize(finished_study, tmp_path / "partial", tasks=["ptb"])["ptb"]
    assert numbers["progress"] == {"planned": 22, "finished": 21, "missing": ["paper_mix/lr1e-3-seed6"]}
    row = next(r for r in numbers["comparisons"] if (r["variant"], r["reference"]) == ("paper_mix", "softmax"))
    assert row["seeds"] == [1, 2, 3, 4, 5]
    assert "**Incomplete: 21 of 22 cells finished.**" in (tmp_path / "partial" / "study.md").read_text()


def test_a_finished_study_says_so(finished_study, tmp_path):
    summarize.summarize(finished_study, tmp_path / "results", tasks=["ptb"])
    assert "All 22 cells of the protocol finished." in (tmp_path / "results" / "study.md").read_text()


def test_dry_run_prints_the_selection_cells_first(capsys, tmp_path):
    run_grid.main(["--dry_run", "--tasks", "ptb", "--parts", "original", "--runs_dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 + len(protocol.MAIN_SEEDS) * 2 + len(protocol.CONTROL_SEEDS) * 2
    assert all(line.startswith("python run_clm.py ") for line in lines[:4])
    assert all("waits for the learning-rate selection" in line for line in lines[4:])
    run_grid.main(["--dry_run", "--tasks", "ptb_llama", "--runs_dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 + len(protocol.MAIN_SEEDS) * 2
    assert all(line.startswith("python run_clm.py --config_name plat-llama-tiny ") for line in lines[:4])


# --- The original protocol, as published ------------------------------------------------------------------

PUBLISHED = run_grid.REPO / "results"


def original_plan_before_the_amendment(chosen):
    """The original protocol's plan written out from its definitions as they were before the amendment: selection
    runs of both tasks, then seed by seed, per task, softmax, paper_mix and (seeds 1-3) the two controls at the
    paper mix's learning rate. ``chosen``: {(task, arm): learning rate}."""
    cells = [Cell(task, arm, lr, 0, "selection") for task in ("ptb", "fmnist") for arm in ("softmax", "paper_mix")
             for lr in ("1e-3", "3e-3")]
    for seed in range(1, 7):
        for task in ("ptb", "fmnist"):
            cells += [Cell(task, arm, chosen[task, arm], seed, "main") for arm in ("softmax", "paper_mix")]
            if seed <= 3:
                cells += [Cell(task, control, chosen[task, "paper_mix"], seed, "control")
                          for control in ("euler_mix", "paper_mix_eps1e-2")]
    return cells


def published_cells():
    """The cells of the records in results/runs/: the original study's, and the amendment's finished so far."""
    return {Cell(*(json.loads(path.read_text())[k] for k in ("task", "variant", "lr", "seed", "phase")))
            for path in (PUBLISHED / "runs").glob("*/*.json")}


@pytest.fixture
def published_runs(tmp_path):
    """The published records (results/runs/) restored as the finished cells of a runs folder."""
    runs_dir = tmp_path / "published"
    restored = run_grid.restore_records(PUBLISHED / "runs", runs_dir)
    assert len(restored) == len(list((PUBLISHED / "runs").glob("*/*.json")))
    assert not run_grid.restore_records(PUBLISHED / "runs", runs_dir)  # once only
    return runs_dir


def test_original_plan_is_unchanged_by_the_amendment(published_runs):
    selection = run_grid.selection_results(published_runs, list(protocol.TASKS))
    # Chosen at seed 0 in the published study (results/README.md).
    chosen = {("ptb", "softmax"): "1e-3", ("ptb", "paper_mix"): "3e-3", ("fmnist", "softmax"): "1e-3",
              ("fmnist", "paper_mix"): "1e-3"}
    expected = original_plan_before_the_amendment(chosen)
    assert len(expected) == 44
    assert protocol.planned_cells(selection, ("ptb", "fmnist"), ("original",)) == expected
    # Every part of every task: the original's cells come first, in the same order.
    assert protocol.planned_cells(selection)[:44] == expected
    # Each published record is one of these cells, at the path the plan gives it.
    # The amendment's cells are published beside them as they finish.
    original = {cell for cell in published_cells() if protocol.part_of(cell.task, cell.variant) == "original"}
    assert original == set(expected)
    assert all(run_grid.record_of(cell, published_runs) is not None for cell in expected)
    assert [protocol.part_of(c.task, c.variant) for c in expected] == ["original"] * 44


def test_published_records_are_summarised_as_before(published_runs, tmp_path):
    """Restored, the published records give the published study.json's numbers and study.md's tables."""
    summarize.summarize(published_runs, tmp_path / "results")
    numbers = json.loads((tmp_path / "results" / "study.json").read_text())
    published = json.loads((PUBLISHED / "study.json").read_text())
    assert set(numbers) == set(published) and set(numbers) - {"amendment"} == {"ptb", "fmnist"}
    for task in numbers:
        assert numbers[task] == published[task]
    assert sum(len(numbers[task]["comparisons"]) for task in ("ptb", "fmnist")) == 10
    published_lines = set((PUBLISHED / "study.md").read_text().splitlines())
    lines = (tmp_path / "results" / "study.md").read_text().splitlines()
    assert [line for line in lines if line not in published_lines] == [
        "Generated by `experiments/summarize.py` from `published`; protocol in `experiments/README.md`."]


# --- The amendment ----------------------------------------------------------------------------------------

def test_the_amendments_rerun_cells_reproduce_their_records_bit_for_bit():
    """results/check/ holds cells of the amendment re-run into another folder: every metric but the timings is the
    published record's, to the last bit (results/README.md says so)."""
    checked = 0
    for path in sorted((PUBLISHED / "check").glob("*.json")):
        rerun = json.loads(path.read_text())
        if protocol.part_of(rerun["task"], rerun["variant"]) != "amendment":
            continue
        name = f"{rerun['variant']}-lr{rerun['lr']}-seed{rerun['seed']}.json"
        record = json.loads((PUBLISHED / "runs" / rerun["task"] / name).read_text())
        timing = {key for key in record["results"] if key.endswith(("_runtime", "_per_second"))}
        assert {k: v for k, v in rerun["results"].items() if k not in timing} == {
            k: v for k, v in record["results"].items() if k not in timing}, path.name
        assert rerun["config_overrides"] == record["config_overrides"]
        checked += 1
    assert checked >= 3


def test_new_arms_override_the_formulation_of_the_mix():
    mix = "plap_p=[1.5,1.5,1.5,1.5,2.5,2.5,2.5,2.5]"
    assert protocol.variant_overrides("softmax_selfweight", 8) == f"{mix},plap_formulation=selfweight"
    assert protocol.variant_overrides("paper_mix_noself", 8) == f"{mix},plap_formulation=noself"
    assert protocol.variant_overrides("paper_mix_noself", 3) == "plap_p=[1.5,1.5,2.5],plap_formulation=noself"
    assert PTB.amendment_arms == ("softmax_selfweight", "paper_mix_noself")
    assert protocol.TASKS["fmnist"].amendment_arms == ()


def test_ptb_llama_is_the_ptb_task_on_the_llama_shaped_preset():
    llama = protocol.TASKS["ptb_llama"]
    assert (llama.script, llama.preset, llama.steps, llama.recipe) == ("run_clm.py", "plat-llama-tiny", 450, PTB.recipe)
    assert (llama.arms, llama.controls, llama.amendment_arms) == ((), (), ("softmax", "paper_mix"))
    assert protocol.preset_heads(llama) == 8
    pending = protocol.planned_cells({}, ["ptb_llama"])
    assert pending[:4] == [Cell("ptb_llama", arm, lr, 0, "selection") for arm in ("softmax", "paper_mix")
                           for lr in ("1e-3", "3e-3")]
    assert len(pending) == 4 + 6 * 2 and all(c is None for c in pending[4:])
    assert protocol.planned_cells({}, ["ptb_llama"], ["original"]) == []
    scores = {"softmax": {"1e-3": 290.0, "3e-3": 300.0}, "paper_mix": {"1e-3": 280.0, "3e-3": 270.0}}
    selection = {cell: {PTB.selection: scores[cell.variant][cell.lr]} for cell in pending[:4]}
    plan = protocol.planned_cells(selection, ["ptb_llama"])[4:]
    assert [(c.variant, c.lr, c.seed, c.phase) for c in plan] == [
        (arm, lr, seed, "main") for seed in range(1, 7) for arm, lr in (("softmax", "1e-3"), ("paper_mix", "3e-3"))]


@pytest.mark.parametrize("task, variant", [("ptb", "softmax_selfweight"), ("ptb", "paper_mix_noself"),
                                           ("ptb_llama", "softmax"), ("ptb_llama", "paper_mix")])
def test_amendment_commands_parse_into_their_configs(task, variant, tmp_path):
    """Each amendment cell's command parses as run_clm.py parses it, and its config builds a model that runs."""
    import torch
    from transformers import HfArgumentParser

    from modeling_plat import PlatForCausalLM
    from plat_train.arguments import PlatTrainingArguments, parse_args
    from plat_train.causal_lm import TextDataArguments, TextModelArguments
    from plat_train.model_setup import build_config

    cell = Cell(task, variant, "1e-3", 1, "main")
    command = run_grid.cell_command(cell, tmp_path)
    assert command[1].endswith("run_clm.py")
    parser = HfArgumentParser((TextModelArguments, TextDataArguments, PlatTrainingArguments))
    model_args, _, training_args = parse_args(parser, command[2:])
    assert (training_args.max_steps, training_args.learning_rate, training_args.seed) == (450, 1e-3, 1)
    config = build_config(model_args, "text-generation")
    expected_p = [1.5] * 4 + [2.5] * 4 if protocol.VARIANTS[variant].p == "mix" else 2.0
    assert config.plap_p == expected_p and config.plap_formulation == protocol.VARIANTS[variant].formulation
    if task == "ptb_llama":
        shape = (config.position_embedding_type, config.num_attention_heads, config.num_key_value_heads)
        assert shape == ("rope", 8, 4)
    config.vocab_size = 50  # the job sets it from its tokenizer
    torch.manual_seed(0)
    logits = PlatForCausalLM(config).eval()(torch.randint(0, 50, (2, 16))).logits
    assert logits.shape == (2, 16, 50) and torch.isfinite(logits).all()


def test_parse_cell_knows_each_tasks_variants():
    cell = Cell("ptb", "softmax_selfweight", "3e-3", 4, "main")
    assert run_grid.parse_cell("ptb/softmax_selfweight/lr3e-3-seed4") == cell
    assert run_grid.parse_cell("ptb_llama/paper_mix/lr1e-3-seed0").phase == "selection"
    for text in ("fmnist/paper_mix_noself/lr1e-3-seed1", "ptb_llama/euler_mix/lr3e-3-seed1"):
        with pytest.raises(Exception, match="does not plan"):
            run_grid.parse_cell(text)


# Primary endpoint (test perplexity) per seed 1-6 of the factorial's arms and of the Llama-shaped task's.
FACTORIAL = {"softmax": [280, 290, 285, 300, 275, 295], "paper_mix": [240, 248, 246, 255, 238, 250],
             "softmax_selfweight": [250, 262, 255, 268, 249, 263], "paper_mix_noself": [270, 276, 275, 290, 262, 281],
             "euler_mix": [260, 270, 265], "paper_mix_eps1e-2": [262, 271, 266]}
LLAMA = {"softmax": [300, 310, 305, 320, 296, 312], "paper_mix": [290, 305, 300, 310, 299, 300]}
# By hand from the tables above, seed by seed.
HAND = {
    # ((paper_mix - paper_mix_noself) + (softmax_selfweight - softmax)) / 2, e.g. seed 4: (-35 + -32) / 2
    "self_weight": [-30.0, -28.0, -29.5, -33.5, -25.0, -31.5],
    # ((paper_mix - softmax_selfweight) + (paper_mix_noself - softmax)) / 2, e.g. seed 3: (-9 + -10) / 2
    "p_weighting": [-10.0, -14.0, -9.5, -11.5, -12.0, -13.5],
    # (paper_mix - paper_mix_noself) - (softmax_selfweight - softmax), e.g. seed 5: -24 - (-26)
    "interaction": [0.0, 0.0, 1.0, -3.0, 2.0, 1.0],
    # paper_mix - softmax on the Llama-shaped model
    "llama_paper_mix_vs_softmax": [-10.0, -5.0, -5.0, -10.0, 3.0, -12.0],
}
# The exploratory simple effects, one difference of two arms each.
HAND_SIMPLE = {
    "self_weight_alone": [-30.0, -28.0, -30.0, -32.0, -26.0, -32.0],  # softmax_selfweight - softmax
    "self_weight_with_p_weighting": [-30.0, -28.0, -29.0, -35.0, -24.0, -31.0],  # paper_mix - paper_mix_noself
    "p_weighting_alone": [-10.0, -14.0, -10.0, -10.0, -13.0, -14.0],  # paper_mix_noself - softmax
    "p_weighting_with_self_weight": [-10.0, -14.0, -9.0, -13.0, -11.0, -13.0],  # paper_mix - softmax_selfweight
}


def fake_study(runs_dir, tasks=("ptb", "ptb_llama"), parts=protocol.PARTS):
    """Every cell of ``tasks`` in ``parts``: selection at seed 0 (1e-3 wins, except for paper_mix), then the tables."""
    def selection_value(cell):
        return 300.0 + (cell.lr == "1e-3") * (10 if cell.variant == "paper_mix" else -10)

    for cell in protocol.planned_cells({}, tasks, parts):
        if cell is not None:
            fake_cell(runs_dir, cell, 400.0, selection=selection_value(cell))
    plan = protocol.planned_cells(run_grid.selection_results(runs_dir, tasks), tasks, parts)
    for cell in plan:
        if cell.phase != "selection":
            table = LLAMA if cell.task == "ptb_llama" else FACTORIAL
            fake_cell(runs_dir, cell, float(table[cell.variant][cell.seed - 1]))
    return plan


def test_runner_runs_only_the_amendments_cells_and_none_twice(published_runs, monkeypatch):
    for cell in published_cells():  # as before any amendment cell ran
        if protocol.part_of(cell.task, cell.variant) == "amendment":
            shutil.rmtree(cell.path(published_runs))
    ran = []

    def fake_run_cell(cell, runs_dir, extra_args=()):
        ran.append(cell)
        fake_cell(runs_dir, cell, 250.0, selection=250.0 + (cell.lr == "3e-3"))

    monkeypatch.setattr(run_grid, "run_cell", fake_run_cell)
    assert run_grid.run_study(published_runs, list(protocol.TASKS), parts=["amendment"], wait_seconds=0) == []
    assert len(ran) == len(set(ran)) == 2 * 4 + 6 * 4  # selection of 4 arms, then 6 seeds of 4 arms
    assert {protocol.part_of(c.task, c.variant) for c in ran} == {"amendment"}
    assert ran[:8] == protocol.selection_cells("ptb", ["amendment"]) + protocol.selection_cells("ptb_llama")
    # Seed by seed: a runner stopped part-way leaves complete seeds.
    assert [c.seed for c in ran[8:]] == [seed for seed in range(1, 7) for _ in range(4)]
    assert {c.lr for c in ran[8:]} == {"1e-3"}
    ran.clear()
    assert run_grid.run_study(published_runs, list(protocol.TASKS), wait_seconds=0) == [] and ran == []


def test_contrasts_are_the_hand_computed_ones(tmp_path):
    from scipy import stats

    fake_study(tmp_path / "runs")
    numbers = summarize.summarize(tmp_path / "runs", tmp_path / "results")
    rows = {row["name"]: row for row in numbers["amendment"]["contrasts"]}
    assert list(rows) == [c.name for c in protocol.CONTRASTS]
    for name, values in HAND.items():
        row = rows[name]
        assert row["seeds"] == [1, 2, 3, 4, 5, 6] and row["values"] == pytest.approx(values)
        mean, sd = sum(values) / 6, stats.tstd(values)
        half = stats.t.ppf(0.975, 5) * sd / 6 ** 0.5
        assert (row["mean"], row["ci_low"], row["ci_high"]) == pytest.approx((mean, mean - half, mean + half))
        assert row["p_value"] == pytest.approx(stats.ttest_1samp(values, 0).pvalue)
        assert (row["negative"], row["positive"]) == (sum(v < 0 for v in values), sum(v > 0 for v in values))
    assert (rows["interaction"]["negative"], rows["interaction"]["positive"]) == (1, 3)  # two seeds exactly 0
    # Holm over the amended family of four, by hand: the i-th smallest p times (5 - i), kept monotone.
    order = sorted(rows, key=lambda name: rows[name]["p_value"])
    running = 0.0
    for rank, name in enumerate(order):
        running = max(running, min(1.0, (4 - rank) * rows[name]["p_value"]))
        assert rows[name]["holm_p"] == pytest.approx(running)
    # The simple effects: outside the family, unadjusted.
    simple = {row["name"]: row for row in numbers["amendment"]["simple_effects"]}
    assert list(simple) == list(HAND_SIMPLE)
    for name, values in HAND_SIMPLE.items():
        assert simple[name]["values"] == pytest.approx(values) and "holm_p" not in simple[name]
        assert simple[name]["p_value"] == pytest.approx(stats.ttest_1samp(values, 0).pvalue)
    # Each main effect is the mean of its two simple effects, the interaction their difference.
    for seed in range(6):
        assert rows["self_weight"]["values"][seed] == pytest.approx(
            (HAND_SIMPLE["self_weight_alone"][seed] + HAND_SIMPLE["self_weight_with_p_weighting"][seed]) / 2)
        assert rows["interaction"]["values"][seed] == pytest.approx(
            HAND_SIMPLE["p_weighting_with_self_weight"][seed] - HAND_SIMPLE["p_weighting_alone"][seed])
    # The original family is untouched by the contrasts: its five PTB comparisons, Holm among themselves.
    original = numbers["ptb"]["comparisons"]
    assert len(original) == 5
    assert [r["holm_p"] for r in original] == pytest.approx(paired_stats.holm([r["p_value"] for r in original]))
    assert set(numbers["ptb"]["arms"]) == set(PTB.arms + PTB.controls)
    assert numbers["ptb"]["progress"] == {"planned": 22, "finished": 22, "missing": []}


def test_amendment_summary_writes_its_section_plots_and_records(tmp_path):
    fake_study(tmp_path / "runs")
    results_dir = tmp_path / "results"
    summarize.main(["--runs_dir", str(tmp_path / "runs"), "--results_dir", str(results_dir)])
    numbers = json.loads((results_dir / "study.json").read_text())
    amendment = numbers["amendment"]
    assert amendment["progress"] == {"planned": 16 + 16, "finished": 32, "missing": []}
    assert amendment["selection"]["ptb"]["softmax_selfweight"] == {"scores": {"1e-3": 290.0, "3e-3": 300.0},
                                                                   "chosen": "1e-3"}
    assert list(amendment["arms"]["ptb"]) == ["softmax", "paper_mix", "softmax_selfweight", "paper_mix_noself"]
    assert amendment["arms"]["ptb_llama"]["paper_mix"]["lr"] == "3e-3"
    assert [g["step"] for g in amendment["gaps"]["ptb_llama"]] == list(range(75, 451, 75))
    assert "ptb" not in amendment["gaps"]  # its gap is the original section's
    table = (results_dir / "study.md").read_text()
    assert "## Amendment (2026-11-24)" in table and "All 32 cells of the amendment finished." in table
    assert ("| self_weight | ptb | 0.5 paper_mix - 0.5 paper_mix_noself + 0.5 softmax_selfweight - 0.5 softmax | 6 | "
            "-29.6 |") in table
    assert "1: -30.0, 2: -28.0, 3: -29.5, 4: -33.5, 5: -25.0, 6: -31.5 |" in table
    assert "| interaction | ptb | paper_mix - paper_mix_noself - softmax_selfweight + softmax | 6 | +0.2 |" in table
    assert "| ptb_llama | paper_mix | 3e-3 | 6 |" in table
    assert ("| p_weighting_with_self_weight | ptb | paper_mix - softmax_selfweight | 6 | -11.7 |") in table
    assert "Exploratory, not among the amendment's tests" in table
    for name in ("amendment_learning_curves.png", "amendment_contrasts.png"):
        assert (results_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({name})" in table
    raw = json.loads((results_dir / "runs" / "ptb_llama" / "paper_mix-lr3e-3-seed2.json").read_text())
    assert raw["results"][PTB.primary] == LLAMA["paper_mix"][1]
    assert raw["command"].startswith("python run_clm.py --config_name plat-llama-tiny")


def test_missing_cells_leave_contrasts_out(tmp_path):
    runs_dir = tmp_path / "runs"
    fake_study(runs_dir)
    for seed in range(2, 7):  # one seed left of paper_mix_noself: no factorial contrast but the self-weight-free one
        (runs_dir / "ptb" / "paper_mix_noself" / f"lr1e-3-seed{seed}" / "cell.json").unlink()
    (runs_dir / "ptb_llama" / "softmax" / "lr1e-3-seed6" / "cell.json").unlink()
    amendment = summarize.summarize(runs_dir, tmp_path / "results")["amendment"]
    (row,) = amendment["contrasts"]
    assert row["name"] == "llama_paper_mix_vs_softmax" and row["seeds"] == [1, 2, 3, 4, 5]
    assert row["values"] == pytest.approx(HAND["llama_paper_mix_vs_softmax"][:5])
    assert row["holm_p"] == row["p_value"]  # a family of one
    assert amendment["progress"]["finished"] == 32 - 6
    assert "ptb/paper_mix_noself/lr1e-3-seed2" in amendment["progress"]["missing"]
    assert "ptb_llama/softmax/lr1e-3-seed6" in amendment["progress"]["missing"]


def test_amendment_of_the_original_alone_has_no_section(finished_study, tmp_path):
    numbers = summarize.summarize(finished_study, tmp_path / "results", tasks=["ptb"])
    assert "amendment" not in numbers and "Amendment" not in (tmp_path / "results" / "study.md").read_text()


def test_a_summary_keeps_diagnostics_measured_before(finished_study, tmp_path):
    metrics = {name: [0.5, 0.5, 2.0] for name in ("energy", "energy_rate", "step_energy_ratio", "max_offdiag_rowsum",
                                                    "attention_hc_dc_gain", "attention_hc_dc_gain_without_self_weight",
                                                    "lambda_max_softmax", "lambda_max_effective")}
    report = {"models": {"paper_mix/seed1": {"layers": [{"p": [1.5, 1.5, 2.5], **metrics}]}}}
    folder = tmp_path / "results" / "diagnostics" / "ptb"
    folder.mkdir(parents=True)
    (folder / "diagnostics.json").write_text(json.dumps(report))
    summarize.summarize(finished_study, tmp_path / "results", tasks=["ptb"])
    table = (tmp_path / "results" / "study.md").read_text()
    assert "Per-head diagnostics of every seed's final model (`diagnostics/ptb/`" in table
    assert "| paper_mix | 1.5 | 0.5 [0.5, 0.5] |" in table
