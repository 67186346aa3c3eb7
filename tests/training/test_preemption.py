"""``--enable_jit_checkpoint``: SIGTERM stops training at a checkpoint that resumes to the run that was not stopped,
the weight average saved beside it, and SIGTERM left as it was outside training (plat_train/preemption.py). The jobs'
exit: tests/robustness/test_checkpoints.py; processes signalled apart: tests/robustness/test_distributed.py."""

import os
import signal

import pytest
import torch
from tiny import lm
from transformers import TrainerCallback, TrainingArguments

from device import ON_CUDA
from plat_train.ema import EMA_WEIGHTS_NAME, ModelEmaCallback
from plat_train.runs import checkpoint_folders, last_complete_checkpoint
from plat_train.trainers import PlatTrainer

STEPS = 6


class SigtermAt(TrainerCallback):
    """Sends this process SIGTERM at the start of optimizer step ``step`` (1-based), or once training ends."""

    def __init__(self, step=None):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, args, state, control, **kwargs):
        if self.step is None:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def rows():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 61, (24, 8), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


class Recorder(list):
    """A signal handler that records the signals it gets."""

    def __call__(self, signum, frame):
        self.append(signum)


@pytest.fixture
def recorded_sigterm():
    """SIGTERM's handler while the test runs, a ``Recorder``."""
    recorder = Recorder()
    previous = signal.signal(signal.SIGTERM, recorder)
    yield recorder
    signal.signal(signal.SIGTERM, previous)


def trainer(output_dir, rows, *callbacks, jit=True):
    """A PlatTrainer of the tiny LM with ``callbacks`` (the weight average's among them)."""
    args = TrainingArguments(output_dir, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=3e-3,
                             save_strategy="no", report_to=[], enable_jit_checkpoint=jit, use_cpu=not ON_CUDA,
                             seed=5)  # fmt: skip
    return PlatTrainer(lm(), args, train_dataset=rows, callbacks=list(callbacks))


def test_sigterm_saves_the_step_and_resuming_gives_the_run_not_stopped(tmp_path, rows, recorded_sigterm):
    straight_ema = ModelEmaCallback(0.9)
    straight = trainer(tmp_path / "straight", rows, straight_ema)
    straight.train()
    assert straight.stopped_at() is None and straight.state.global_step == STEPS

    stopped = trainer(tmp_path / "stopped", rows, ModelEmaCallback(0.9), SigtermAt(3))
    assert signal.getsignal(signal.SIGTERM) is recorded_sigterm  # until training starts
    stopped.train()
    assert stopped.stopped_at() == 3 and stopped.state.global_step == 3
    assert not recorded_sigterm  # taken by the trainer while training, handed back after it
    assert signal.getsignal(signal.SIGTERM) is recorded_sigterm
    # One checkpoint, whole: Trainer's files and the weight average (saved by its callback beside them).
    assert checkpoint_folders(tmp_path / "stopped") == [tmp_path / "stopped" / "checkpoint-3"]
    checkpoint = last_complete_checkpoint(tmp_path / "stopped", (EMA_WEIGHTS_NAME,))
    assert checkpoint == str(tmp_path / "stopped" / "checkpoint-3")

    ema = ModelEmaCallback(0.9, resume_from_checkpoint=checkpoint)
    resumed = trainer(tmp_path / "stopped", rows, ema)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == STEPS
    for mine, reference in zip(resumed.model.parameters(), straight.model.parameters()):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)
    for mine, reference in zip(ema.shadow, straight_ema.shadow):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)


def test_sigterm_after_the_last_step_reaches_the_handler_it_had_before(tmp_path, rows, recorded_sigterm):
    finished = trainer(tmp_path, rows, SigtermAt())
    finished.train()
    assert finished.stopped_at() is None and finished.state.global_step == STEPS
    assert recorded_sigterm == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is recorded_sigterm
    assert checkpoint_folders(tmp_path) == []


def test_without_the_flag_sigterm_is_left_alone(tmp_path, rows, recorded_sigterm):
    run = trainer(tmp_path, rows, SigtermAt(2), jit=False)
    run.train()
    assert run.sigterm_stop is None and run.stopped_at() is None and run.state.global_step == STEPS
    assert recorded_sigterm == [signal.SIGTERM]
