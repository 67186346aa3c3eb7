"""The study's bookkeeping: the protocol's cells and learning-rate choice, the runner's commands and claims, and
the summary's numbers and files (on fake finished cells)."""

import json
import math
import os
import shlex

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
    folder = cell.path(runs_dir)
    folder.mkdir(parents=True)
    # Validation loss along training: the curve ends at the primary endpoint's log.
    history = [{"step": step, "eval_loss": math.log(primary) + (PTB.steps - step) / 1000} for step in range(75, 451, 75)]
    # Training log entries with a gradient norm that peaks at the seed's number.
    history += [{"step": step, "loss": 5.0, "grad_norm": cell.seed * step / 450} for step in (25, 450, 300)]
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    results = {PTB.primary: primary, PTB.selection: selection if selection is not None else primary + 10}
    record = {"task": cell.task, "variant": cell.variant, "lr": cell.lr, "seed": cell.seed, "phase": cell.phase,
              "command": run_grid.shown(shlex.join(run_grid.cell_command(cell, runs_dir))), "results": results}
    (folder / "cell.json").write_text(json.dumps(record))


@pytest.fixture
def finished_study(tmp_path):
    runs_dir = tmp_path / "runs"
    for (arm, lr), value in SELECTION.items():
        fake_cell(runs_dir, Cell("ptb", arm, lr, 0, "selection"), value + 5, selection=value)
    plan = protocol.planned_cells(run_grid.selection_results(runs_dir, ["ptb"]), ["ptb"])
    for cell in plan[4:]:
        fake_cell(runs_dir, cell, PRIMARY[cell.variant][cell.seed - 1])
    return runs_dir


def test_learning_rate_is_chosen_per_arm_on_the_selection_seed(finished_study):
    results = run_grid.selection_results(finished_study, ["ptb"])
    assert protocol.choose_learning_rate("ptb", "softmax", results) == "3e-3"
    assert protocol.choose_learning_rate("ptb", "paper_mix", results) == "1e-3"
    assert protocol.choose_learning_rate("ptb", "softmax", {}) is None


def test_plan_waits_for_the_selection_then_pairs_seeds(finished_study):
    pending = protocol.planned_cells({}, ["ptb"])
    assert pending[:4] == protocol.selection_cells("ptb") and all(c is None for c in pending[4:])
    plan = protocol.planned_cells(run_grid.selection_results(finished_study, ["ptb"]), ["ptb"])[4:]
    by_variant = {v: [c for c in plan if c.variant == v] for v in protocol.VARIANTS}
    assert [c.seed for c in by_variant["softmax"]] == list(protocol.MAIN_SEEDS)
    assert {c.lr for c in by_variant["softmax"]} == {"3e-3"} and {c.lr for c in by_variant["paper_mix"]} == {"1e-3"}
    # The controls run at the learning rate chosen for the paper's mix, on the first seeds.
    for control in protocol.CONTROLS:
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
    run_grid.main(["--dry_run", "--tasks", "ptb", "--runs_dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 + len(protocol.MAIN_SEEDS) * 2 + len(protocol.CONTROL_SEEDS) * 2
    assert all(line.startswith("python run_clm.py ") for line in lines[:4])
    assert all("waits for the learning-rate selection" in line for line in lines[4:])
