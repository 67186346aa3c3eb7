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

    for step, files in ((2, ("config.json", "trainer_state.json")), (4, ("config.json",)), (10, ())):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        for name in files:
            (folder / name).write_text("{}")
    (tmp_path / "checkpoint-final").mkdir()
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    assert "checkpoint-4" in caplog.text and "did not finish" in caplog.text


def test_run_killed_mid_training_resumes_to_the_same_result(tmp_path):
    """SIGKILL after the first checkpoint, rerun the same command: same final metrics as an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tiny import FAST, TINY_MODEL, write_lines

    train, validation = write_lines(tmp_path / "train.txt", 200), write_lines(tmp_path / "valid.txt", 20, seed=1)
    script = Path(__file__).resolve().parents[2] / "run_clm.py"

    def command(output_dir):
        # The Trainer takes a GPU where there is one: --use_cpu keeps the runs on the tests' device if that is the CPU.
        return [sys.executable, str(script), *TINY_MODEL, *FAST, "--train_file", str(train), "--validation_file",
                str(validation), "--do_train", "--do_eval", "--max_steps", "24", "--save_steps", "4",
                "--seed", "3", "--learning_rate", "3e-3", "--output_dir", str(output_dir), "--disable_tqdm", "true",
                *([] if ON_CUDA else ["--use_cpu"])]

    def metrics(output_dir):
        return json.loads((output_dir / "all_results.json").read_text())

    subprocess.run(command(tmp_path / "straight"), check=True, capture_output=True, timeout=600)

    killed = tmp_path / "killed"
    process = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (killed / "checkpoint-4" / "trainer_state.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "all_results.json").exists()
    resumed = subprocess.run(command(killed), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming training at" in resumed.stdout + resumed.stderr
    straight, again = metrics(tmp_path / "straight"), metrics(killed)
    assert again["eval_loss"] == pytest.approx(straight["eval_loss"], rel=1e-4)
