"""Damaged checkpoints fail loudly and whole: never a half-loaded model; saved from and loaded straight onto the
tests' device (tests/device.py)."""

import json

import pytest

from device import DEVICE, ON_CUDA
from modeling_plat import PlatForCausalLM
from tiny import lm


@pytest.fixture
def checkpoint(tmp_path):
    lm().to(DEVICE).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("keep", [0.5, 0.99, 4])
def test_truncated_weights_raise_a_clear_error(checkpoint, keep):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(OSError, match="truncated or corrupt"):
        PlatForCausalLM.from_pretrained(checkpoint, device_map=DEVICE)


def test_garbage_weights_raise_a_clear_error(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(OSError, match="truncated or corrupt"):
        PlatForCausalLM.from_pretrained(checkpoint, device_map=DEVICE)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"plat_config_version": 2}, "newer plat"),
        ({"plap_p": [1.5] * 5}, "one value per head"),
        ({"plap_backend": "flash9"}, "plap_backend"),
        ({"plap_formulation": "implicit"}, "plap_formulation"),
        ({"num_attention_heads": 3}, "divisible"),
    ],
)
def test_incompatible_config_raises_a_clear_error(checkpoint, change, message):
    path = checkpoint / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ValueError, match=message):
        PlatForCausalLM.from_pretrained(checkpoint, device_map=DEVICE)


def test_partial_checkpoint_is_never_resumed_from(tmp_path, caplog):
    from plat_train.runs import last_complete_checkpoint

    # A run killed while saving: before the state (4, 10), or while writing it (6: opened, 8: cut short, 12: not text).
    whole_state = json.dumps({"global_step": 2, "log_history": []}, indent=2)
    states = {2: whole_state, 6: "", 8: whole_state[:-1], 12: "\udcff"}
    for step in (2, 4, 6, 8, 10, 12):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if step != 10:
            (folder / "config.json").write_text("{}")
        if step in states:
            (folder / "trainer_state.json").write_bytes(states[step].encode(errors="surrogateescape"))
    (tmp_path / "checkpoint-final").mkdir()
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    skipped = [line for line in caplog.text.splitlines() if "did not finish" in line]
    assert [f"checkpoint-{step}" in line for step, line in zip((12, 10, 8, 6, 4), skipped)] == [True] * 5


def test_an_output_dir_without_a_finished_checkpoint_is_trained_into_only_if_a_run_left_nothing_else(tmp_path, caplog):
    from types import SimpleNamespace

    from plat_train.ema import EMA_WEIGHTS_NAME
    from plat_train.runs import detect_last_checkpoint

    args = SimpleNamespace(resume_from_checkpoint=None, output_dir=str(tmp_path), do_train=True)
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("")  # killed while writing it
    (tmp_path / "runs").mkdir()  # TensorBoard's logs
    assert detect_last_checkpoint(args) is None and "training from the start" in caplog.text
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert detect_last_checkpoint(args) == str(tmp_path / "checkpoint-4")
    # Finished as Trainer sees it, but without the average the job also needs: kept, not trained over.
    with pytest.raises(ValueError, match="not empty"):
        detect_last_checkpoint(args, (EMA_WEIGHTS_NAME,))
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("")
    (tmp_path / "all_results.json").write_text("{}")  # what else a run writes: a finished run's
    with pytest.raises(ValueError, match="not empty"):
        detect_last_checkpoint(args)


def test_a_checkpoint_named_to_resume_from_is_checked_before_any_work(tmp_path):
    """A path that is no folder (which the tokenizer's loading would take for a Hub id, trying the network) or an
    unfinished checkpoint is refused at once; a finished one is taken without the files only the job's callbacks need
    (the weight average then restarts, with a warning)."""
    from types import SimpleNamespace

    from plat_train.ema import EMA_WEIGHTS_NAME
    from plat_train.runs import detect_last_checkpoint

    def named(path):
        return SimpleNamespace(resume_from_checkpoint=str(path), output_dir=str(tmp_path / "out"), do_train=True)

    with pytest.raises(ValueError, match="nowhere/checkpoint-9 cannot be resumed from: there is no such folder"):
        detect_last_checkpoint(named("nowhere/checkpoint-9"))
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2')
    with pytest.raises(ValueError, match="checkpoint-2 cannot be resumed from: its trainer_state.json is missing"):
        detect_last_checkpoint(named(tmp_path / "checkpoint-2"))
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    finished = tmp_path / "checkpoint-2"
    assert detect_last_checkpoint(named(finished), (EMA_WEIGHTS_NAME,)) == str(finished)


def whole_json(path):
    try:
        return bool(json.loads(path.read_text()))
    except (OSError, ValueError):
        return False


def results(output_dir):
    return json.loads((output_dir / "all_results.json").read_text())


@pytest.fixture(scope="module")
def clm_job(tmp_path_factory):
    """run_clm.py's command for 64 steps on lines of random words, saving every 4, into a given folder (more flags
    after it); and the results of that run when nothing stops it. A signal sent once the first checkpoint is whole
    reaches the run with about 60 steps to go (a second or more)."""
    import subprocess
    import sys
    from pathlib import Path

    from tiny import FAST, TINY_MODEL, write_lines

    folder = tmp_path_factory.mktemp("clm-job")
    train, validation = write_lines(folder / "train.txt", 200), write_lines(folder / "valid.txt", 20, seed=1)
    script = Path(__file__).resolve().parents[2] / "run_clm.py"

    def command(output_dir, *flags):
        # The Trainer takes a GPU where there is one: --use_cpu keeps the runs on the tests' device if that is the CPU.
        return [sys.executable, str(script), *TINY_MODEL, *FAST, "--train_file", str(train), "--validation_file",
                str(validation), "--do_train", "--do_eval", "--max_steps", "64", "--save_steps", "4",
                "--seed", "3", "--learning_rate", "3e-3", "--output_dir", str(output_dir), "--disable_tqdm", "true",
                *([] if ON_CUDA else ["--use_cpu"]), *flags]  # fmt: skip

    subprocess.run(command(folder / "straight"), check=True, capture_output=True, timeout=600)
    return command, results(folder / "straight")


def stopped_after_first_checkpoint(command, output_dir, signum):
    """Runs ``command`` and sends it ``signum`` once its first checkpoint is whole; its output when it has ended."""
    import subprocess
    import time

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not whole_json(output_dir / "checkpoint-4" / "trainer_state.json"):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)
    process.send_signal(signum)
    output = process.communicate(timeout=300)[0]
    return process.returncode, output


def resumed(command, output_dir):
    """Runs ``command`` again into ``output_dir``: the checkpoint it resumed from (its log line), and its results."""
    import re
    import subprocess

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    return re.findall(r"resuming training at (\S+)\.", again.stdout + again.stderr), results(output_dir)


def test_run_killed_mid_training_resumes_to_the_same_result(tmp_path, clm_job):
    """SIGKILL after the first checkpoint, rerun the same command: same final metrics as an uninterrupted run."""
    import signal

    command, straight = clm_job
    killed = tmp_path / "killed"
    returncode, _ = stopped_after_first_checkpoint(command(killed), killed, signal.SIGKILL)
    assert returncode == -signal.SIGKILL and not (killed / "all_results.json").exists()
    resumed_from, again = resumed(command(killed), killed)
    assert len(resumed_from) == 1
    assert again["eval_loss"] == pytest.approx(straight["eval_loss"], rel=1e-4)


def test_run_stopped_by_sigterm_saves_its_step_ends_and_resumes_to_the_same_result(tmp_path, clm_job):
    """--enable_jit_checkpoint, SIGTERM after the first checkpoint: the step under way is saved, the job ends with
    status 143 leaving no results or final model, and the same command resumes from that step to the same result."""
    import signal

    from plat_train.preemption import STOPPED_STATUS
    from plat_train.runs import checkpoint_folders, unfinished_reason

    command, straight = clm_job
    stopped = tmp_path / "stopped"
    returncode, output = stopped_after_first_checkpoint(command(stopped, "--enable_jit_checkpoint", "true"), stopped,
                                                        signal.SIGTERM)  # fmt: skip
    assert returncode == STOPPED_STATUS, output[-3000:]
    newest = checkpoint_folders(stopped)[0]
    step = int(newest.name.removeprefix("checkpoint-"))
    assert 4 < step < 64 and unfinished_reason(newest) is None
    assert f"Training stopped on SIGTERM at step {step} of 64" in output and "run the same command again" in output
    assert not (stopped / "all_results.json").exists() and not (stopped / "model.safetensors").exists()
    resumed_from, again = resumed(command(stopped, "--enable_jit_checkpoint", "true"), stopped)
    assert resumed_from == [str(newest)]
    assert again["eval_loss"] == pytest.approx(straight["eval_loss"], rel=1e-4)
