#!/usr/bin/env python
"""Run the study of experiments/protocol.py: every cell is one call of a training script on a preset.

    python experiments/run_grid.py                      # run (or resume) every cell, then stop
    python experiments/run_grid.py --dry_run            # print the cells' commands
    python experiments/run_grid.py --only ptb/paper_mix/lr3e-3-seed1 --runs_dir runs/check   # one cell again
    python experiments/run_grid.py --restore_from results/runs --parts amendment   # the amendment's cells only

Cells whose record (``cell.json``) exists are skipped, so an interrupted study resumes where it stopped;
``--restore_from`` turns the records that summarize.py publishes (``results/runs/``) into such finished cells.
Several runners may work on one runs folder side by side (one per core, ``OMP_NUM_THREADS=1``): each claims
the next cell with a lock file, and a claim whose process has died is taken over. Cells that depend on the
learning-rate selection wait until it is decided. A failed cell is recorded as such (its log beside its
folder) and not retried until its ``failed.json`` is removed. ``experiments/summarize.py`` turns the
records into tables, intervals and plots.
"""

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import protocol
from protocol import REPO, TASKS, Cell

WAIT_SECONDS = 30


def shown(text):
    """``text`` as a reader of the results should see it: python by name, paths inside the repository relative."""
    return str(text).replace(sys.executable, "python").replace(f"{REPO}{os.sep}", "")


def cell_command(cell, runs_dir, extra_args=()):
    task = TASKS[cell.task]
    return [
        sys.executable, str(REPO / task.script),
        "--config_name", task.preset,
        "--config_overrides", protocol.variant_overrides(cell.variant, protocol.preset_heads(task)),
        "--output_dir", str(cell.path(runs_dir)),
        "--do_train", "--do_eval",
        "--max_steps", str(task.steps),
        "--learning_rate", cell.lr,
        "--seed", str(cell.seed),
        "--save_strategy", "no",
        "--report_to", "none",
        "--disable_tqdm", "true",
        *task.recipe,
        *extra_args,
    ]


def read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def record_of(cell, runs_dir):
    return read_json(cell.path(runs_dir) / "cell.json")


def failure_of(cell, runs_dir):
    return read_json(cell.path(runs_dir).with_name(cell.path(runs_dir).name + ".failed.json"))


def selection_results(runs_dir, tasks):
    results = {}
    for task in tasks:
        for cell in protocol.selection_cells(task):  # of every part: the plan of any part may ask
            record = record_of(cell, runs_dir)
            results[cell] = None if record is None else record["results"]
    return results


def machine():
    """What ran a cell: CPU model, cores, threads, library versions (a cell's speed depends on all of them)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# --- Claims: several runners on one runs folder ------------------------------------------------------------


def _claim_path(cell, runs_dir):
    path = cell.path(runs_dir)
    return path.with_name(path.name + ".claim")


def _alive(claim):
    try:
        owner = json.loads(claim.read_text())
    except (OSError, json.JSONDecodeError):
        return True  # being written right now
    if owner.get("host") != socket.gethostname():
        return True  # another machine's runner: trust it
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def try_claim(cell, runs_dir):
    """Take ``cell`` for this process; False if a live runner holds it. A dead runner's claim is taken over."""
    claim = _claim_path(cell, runs_dir)
    claim.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _alive(claim):
                return False
            claim.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as handle:
            json.dump({"pid": os.getpid(), "host": socket.gethostname()}, handle)
        return True
    return False


def release(cell, runs_dir):
    _claim_path(cell, runs_dir).unlink(missing_ok=True)


# --- One cell ------------------------------------------------------------------------------------------------


def run_cell(cell, runs_dir, extra_args=()):
    """Train and evaluate one claimed cell; write its record (or its failure) and return the record or None."""
    output_dir = cell.path(runs_dir)
    if output_dir.exists():
        shutil.rmtree(output_dir)  # a cell that stopped part-way restarts from scratch
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = output_dir.with_name(output_dir.name + ".log")  # beside the folder, which the script wants empty
    command = cell_command(cell, runs_dir, extra_args)
    print(f"[{cell.task} {cell.variant} lr {cell.lr} seed {cell.seed}] {shown(shlex.join(command))}", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        returncode = subprocess.call(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    wall_time = time.perf_counter() - start
    results = read_json(output_dir / "all_results.json")
    task = TASKS[cell.task]
    if returncode != 0 or results is None or task.primary not in results:
        failure = {"returncode": returncode, "log": shown(log_path), "wall_time": wall_time}
        output_dir.with_name(output_dir.name + ".failed.json").write_text(json.dumps(failure, indent=2))
        print(f"  failed (exit {returncode}); see {shown(log_path)}", flush=True)
        return None
    record = {
        **{name: getattr(cell, name) for name in ("task", "variant", "lr", "seed", "phase")},
        "max_steps": task.steps,
        "config_overrides": protocol.variant_overrides(cell.variant, protocol.preset_heads(task)),
        "command": shown(shlex.join(command)),
        "wall_time": wall_time,
        "machine": machine(),
        "results": results,
    }
    (output_dir / "cell.json").write_text(json.dumps(record, indent=2))
    print(f"  done in {wall_time:.0f} s: {task.primary} = {results[task.primary]}", flush=True)
    return record


# --- The loop ------------------------------------------------------------------------------------------------


def run_study(runs_dir, tasks, extra_args=(), wait_seconds=WAIT_SECONDS, parts=protocol.PARTS):
    """Run every unfinished cell of ``tasks`` in ``parts`` that no other runner holds; returns the failed cells."""
    while True:
        plan = protocol.planned_cells(selection_results(runs_dir, tasks), tasks, parts)
        todo = [c for c in plan if c is None or (record_of(c, runs_dir) is None and failure_of(c, runs_dir) is None)]
        if not todo:
            break
        cell = next((c for c in todo if c is not None and try_claim(c, runs_dir)), None)
        if cell is not None and (record_of(cell, runs_dir) or failure_of(cell, runs_dir)):
            release(cell, runs_dir)  # another runner finished it after this pass listed it
            continue
        if cell is None:
            blocked_by_failure = any(failure_of(c, runs_dir) for c in plan if c is not None and c.phase == "selection")
            if blocked_by_failure and all(c is None for c in todo):
                break  # the learning rate can never be chosen
            time.sleep(wait_seconds)  # waiting on the selection or on cells other runners hold
            continue
        try:
            run_cell(cell, runs_dir, extra_args)
        finally:
            release(cell, runs_dir)
    plan = protocol.planned_cells(selection_results(runs_dir, tasks), tasks, parts)
    return [c for c in plan if c is not None and failure_of(c, runs_dir) is not None]


def restore_records(records_dir, runs_dir):
    """Make the records that summarize.py publishes (``<task>/<variant>-lr<lr>-seed<k>.json``, each with its
    training log) finished cells of ``runs_dir``: ``cell.json`` and the ``trainer_state.json`` that the summary
    reads, for every cell that has no record there. Their models are not restored. Returns the cells restored."""
    restored = []
    for path in sorted(Path(records_dir).glob("*/*.json")):
        record = json.loads(path.read_text())
        cell = Cell(*(record[name] for name in ("task", "variant", "lr", "seed", "phase")))
        if record_of(cell, runs_dir) is not None:
            continue
        folder = cell.path(runs_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "trainer_state.json").write_text(json.dumps({"log_history": record.pop("log_history")}))
        (folder / "cell.json").write_text(json.dumps(record, indent=2))  # last: it marks the cell done
        restored.append(cell)
    return restored


def parse_cell(text):
    """``task/variant/lr<lr>-seed<k>`` -> Cell."""
    try:
        task, variant, rest = text.split("/")
        lr, seed = rest.removeprefix("lr").split("-seed")
        cell = Cell(task, variant, lr, int(seed), "selection")
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cell is task/variant/lr<lr>-seed<k>; got {text!r}") from None
    if task not in TASKS or protocol.part_of(task, variant) is None:
        raise argparse.ArgumentTypeError(f"unknown task, or a variant the task does not plan, in {text!r}")
    phase = ("control" if variant in TASKS[task].controls
             else "selection" if cell.seed == protocol.SELECTION_SEED else "main")
    return Cell(task, variant, lr, int(seed), phase)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--parts", nargs="+", choices=protocol.PARTS, default=list(protocol.PARTS),
                        help="the original protocol's cells, its amendment's (2026-11-24), or both")
    parser.add_argument("--runs_dir", default=str(REPO / "runs" / "study"))
    parser.add_argument("--restore_from", default=None, metavar="DIR",
                        help="first make the published records in DIR (e.g. results/runs) finished cells")
    parser.add_argument("--train_args", default="",
                        help="extra flags for every cell, e.g. \"--bf16 --dataloader_num_workers 4\" on a GPU")
    parser.add_argument("--only", type=parse_cell, default=None, metavar="TASK/VARIANT/lrLR-seedK",
                        help="run this one cell (again, if it has a record) and stop")
    parser.add_argument("--dry_run", action="store_true", help="print the commands of the cells known so far")
    args = parser.parse_args(argv)
    extra = shlex.split(args.train_args)

    if args.restore_from is not None:
        restored = restore_records(args.restore_from, args.runs_dir)
        print(f"{len(restored)} finished cell(s) restored from {args.restore_from} into {args.runs_dir}")
    if args.dry_run:
        for cell in protocol.planned_cells(selection_results(args.runs_dir, args.tasks), args.tasks, args.parts):
            print("(waits for the learning-rate selection)" if cell is None
                  else shown(shlex.join(cell_command(cell, args.runs_dir, extra))))
        return
    if args.only is not None:
        if record_of(args.only, args.runs_dir) is not None:
            sys.exit(f"{args.only.path(args.runs_dir)} has a record already: re-run it into another --runs_dir")
        if not try_claim(args.only, args.runs_dir):
            sys.exit(f"{args.only} is held by another runner")
        try:
            record = run_cell(args.only, args.runs_dir, extra)
        finally:
            release(args.only, args.runs_dir)
        sys.exit(0 if record is not None else 1)
    failed = run_study(args.runs_dir, args.tasks, extra, parts=args.parts)
    if failed:
        sys.exit(f"{len(failed)} cell(s) failed: {[str(c.path(args.runs_dir)) for c in failed]}")
    print(f"Every cell of {', '.join(args.tasks)} ({', '.join(args.parts)}) is done; summarise with "
          "experiments/summarize.py")


if __name__ == "__main__":
    main()
