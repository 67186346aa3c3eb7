"""The reproduction grid's bookkeeping: cell commands, the summary statistics and the files it writes."""

import importlib.util
import json
import shlex
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("run_grid", ROOT / "experiments" / "run_grid.py")
run_grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_grid)

PERPLEXITIES = {"softmax": [300.0, 310.0, 320.0], "paper_mix": [250.0, 260.0, 270.0], "all_1.5": [305.0, 315.0, 325.0]}
SECONDS_PER_STEP = {"softmax": 1.0, "paper_mix": 1.5, "all_1.5": 1.25, "all_2.5": 1.25}


def fake_cell(runs_dir, variant, seed, perplexity, steps=150):
    """A finished PTB cell as run_cell leaves it: cell.json and the trainer_state.json its plots read."""
    folder = run_grid.cell_dir(runs_dir, "ptb", variant, seed)
    folder.mkdir(parents=True)
    history = [{"step": step, "loss": 7.0 - step / 100 - seed / 10, "grad_norm": 1.0 + seed + 10 / step}
               for step in range(6, steps + 1, 6)]
    history.append({"step": steps, "train_runtime": SECONDS_PER_STEP[variant] * steps})
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": steps, "log_history": history}))
    # Older cells stored the command as run: with this machine's interpreter and absolute paths.
    command = shlex.join(run_grid.cell_command(run_grid.TASKS["ptb"], variant, seed, steps, folder, []))
    record = {"task": "ptb", "variant": variant, "seed": seed, "max_steps": steps,
              "config_overrides": run_grid.variant_overrides(variant, 8), "command": command,
              "wall_time": 100.0 + seed,
              **run_grid.cost_from_trainer_state(folder), "max_grad_norm": run_grid.max_grad_norm(folder),
              "results": {"test_perplexity": perplexity, "eval_perplexity": perplexity + 20}}
    # run_cell does not store the gradient norm: the summary reads it from trainer_state.json.
    (folder / "cell.json").write_text(json.dumps({k: v for k, v in record.items() if k != "max_grad_norm"}))
    return record


@pytest.fixture
def finished_grid(tmp_path):
    runs_dir = tmp_path / "runs"
    records = [fake_cell(runs_dir, variant, seed, value)
               for variant, values in PERPLEXITIES.items() for seed, value in enumerate(values)]
    fake_cell(runs_dir, "all_2.5", 0, 280.0, steps=99)  # another budget: left out of the summary
    return runs_dir, records


def test_variant_overrides_change_only_p_and_the_formulation():
    assert run_grid.variant_overrides("softmax", 8) == "plap_p=2.0,plap_formulation=paper"
    assert run_grid.variant_overrides("paper_mix", 3) == "plap_p=[1.5,1.5,2.5],plap_formulation=paper"
    assert run_grid.variant_overrides("euler_mix", 8) == f"plap_p={[1.5] * 4 + [2.5] * 4},plap_formulation=euler" \
        .replace(" ", "")


def test_summary_statistics_and_the_spread_test(finished_grid):
    _, records = finished_grid
    rows = run_grid.summarize_task("ptb", records)["variants"]
    for variant, values in PERPLEXITIES.items():
        assert rows[variant]["metric"] == pytest.approx(statistics.fmean(values))
        assert rows[variant]["metric_std"] == pytest.approx(statistics.stdev(values))
        assert rows[variant]["seeds"] == [0, 1, 2]
    assert "difference" not in rows["softmax"]
    assert rows["paper_mix"]["difference"] == pytest.approx(-50.0)
    assert rows["paper_mix"]["beyond_seed_spread"] is True  # 50 > 10 + 10
    assert rows["all_1.5"]["beyond_seed_spread"] is False  # 5 < 10 + 10
    assert rows["paper_mix"]["relative_cost"] == pytest.approx(1.5)
    assert rows["paper_mix"]["max_grad_norm"] == pytest.approx(2.0 + 10 / 6)  # seeds 0, 1, 2: 1 + seed + 10 / 6


def test_single_seed_spread_is_undecided(finished_grid):
    _, records = finished_grid
    first_seed = [r for r in records if r["seed"] == 0]
    assert run_grid.summarize_task("ptb", first_seed)["variants"]["paper_mix"]["beyond_seed_spread"] is None


def test_summarize_writes_the_table_json_and_plots(finished_grid, tmp_path):
    runs_dir, _ = finished_grid
    results_dir = tmp_path / "results"
    run_grid.main(["--summarize_only", "--no-diagnostics", "--runs_dir", str(runs_dir),
                   "--results_dir", str(results_dir)])
    table = (results_dir / "grid.md").read_text()
    assert "| paper_mix |" in table and "260.0 ± 10.0" in table and "-50.0" in table
    assert "all_2.5" not in table  # trained with another budget
    summary = json.loads((results_dir / "grid.json").read_text())
    assert set(summary["ptb"]["variants"]) == set(PERPLEXITIES)
    assert summary["ptb"]["variants"]["all_1.5"]["max_grad_norm"] == pytest.approx(2.0 + 10 / 6)
    raw = sorted(path.name for path in (results_dir / "runs" / "ptb").iterdir())
    assert raw == sorted(f"{variant}-seed{seed}.json" for variant in PERPLEXITIES for seed in range(3))
    paper_mix = json.loads((results_dir / "runs" / "ptb" / "paper_mix-seed1.json").read_text())
    assert paper_mix["results"]["test_perplexity"] == PERPLEXITIES["paper_mix"][1] and paper_mix["log_history"]
    assert paper_mix["command"].startswith("python run_clm.py --config_name plat-ptb-tiny")
    for name in ("ptb_learning_curves.png", "ptb_final.png"):
        assert (results_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in table


def test_dry_run_prints_one_command_per_cell(capsys):
    run_grid.main(["--dry_run", "--tasks", "ptb", "--seeds", "0", "1", "--variants", "softmax", "euler_mix"])
    commands = capsys.readouterr().out.strip().splitlines()
    assert len(commands) == 4
    assert all("--max_steps 150" in c and "--config_name plat-ptb-tiny" in c for c in commands)
    assert sum("plap_formulation=euler" in c for c in commands) == 2
    # Nothing of this machine's layout: the interpreter by name, the script and the default runs folder relative.
    assert all(c.startswith("python run_clm.py ") and "--output_dir runs/grid/ptb/" in c for c in commands)
