"""Training that stops at a checkpoint when the job is asked to end, so that the same command resumes from there.

With ``--enable_jit_checkpoint`` (transformers' flag), SIGTERM (a scheduler preempting the job or reaching its time
limit: Slurm, Kubernetes; ``kill``) ends training at the end of the optimizer step under way. That step's checkpoint
is saved through Trainer's own saving, so callbacks save theirs beside it (the weight average of ``--model_ema``) and
``--save_total_limit`` applies; then the job ends with status 143 (128 + SIGTERM), neither evaluating nor writing a
final model that a finished run would leave. The processes of a distributed run agree on the step: every step ends
with an all-reduce of whether any of them was signalled, so a signal that reaches one node before another still
stops them all at the same step. Outside training, SIGTERM does what it did before the job started.

transformers' own handling of the flag, which the jobs' trainers replace with this, decides in each process alone (a
process signalled before the others saves its part and leaves them waiting in the next step's all-reduce: the job
hangs), saves outside Trainer's saving (no weight average), and lets the job go on as if training had finished:
evaluation, final model, results files, model card, status 0.
"""

import logging
import signal
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_jit_checkpoint import JITCheckpointCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .runs import release_process_group

# What a shell reports for a process that SIGTERM ended.
STOPPED_STATUS = 128 + signal.SIGTERM

logger = logging.getLogger(__name__)


class CheckpointOnSigterm(TrainerCallback):
    """While training, SIGTERM asks for a checkpoint and a stop at the end of the current optimizer step, agreed
    between the processes of a distributed run. ``stopped_at`` is the step stopped at, None while none was.

    ``disposition`` is SIGTERM's handler to restore after training (taken before Trainer installed its own); a
    signal that arrives after the last step is delivered to it then.
    """

    def __init__(self, disposition):
        self.disposition = disposition
        self.signalled = False
        self.stopped_at = None

    def _signalled(self, signum, frame):
        self.signalled = True  # acted on between steps: a handler may interrupt anything, a save included

    def on_train_begin(self, args, state, control, **kwargs):
        self.signalled, self.stopped_at = False, None
        signal.signal(signal.SIGTERM, self._signalled)

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is not None or not self.agreed(args.device):
            return
        control.should_save = control.should_training_stop = True
        self.stopped_at = state.global_step
        if state.is_world_process_zero:
            logger.warning(f"SIGTERM: saving the checkpoint of step {state.global_step} and stopping training")

    def agreed(self, device):
        """Whether any process of the job was signalled: one all-reduce on the backend's device in a distributed
        run."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self.signalled
        flag = torch.tensor([int(self.signalled)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def on_train_end(self, args, state, control, **kwargs):
        signal.signal(signal.SIGTERM, self.disposition)
        if self.signalled and self.stopped_at is None:  # after the last step: nothing left to stop
            signal.raise_signal(signal.SIGTERM)


class CheckpointOnSigtermMixin:
    """Trainer mixin: ``--enable_jit_checkpoint`` stops training at a checkpoint on SIGTERM (``CheckpointOnSigterm``,
    in place of transformers' ``JITCheckpointCallback``); ``sigterm_stop`` is that callback, or None without the
    flag."""

    def __init__(self, *args, **kwargs):
        disposition = signal.getsignal(signal.SIGTERM)
        super().__init__(*args, **kwargs)
        self.sigterm_stop = None
        if self.args.enable_jit_checkpoint:
            self.pop_callback(JITCheckpointCallback)
            signal.signal(signal.SIGTERM, disposition)  # the handler that transformers' callback installed
            self.sigterm_stop = CheckpointOnSigterm(disposition)
            self.add_callback(self.sigterm_stop)

    def stopped_at(self):
        """The step whose checkpoint the last ``train`` stopped at on SIGTERM, or None."""
        return self.sigterm_stop.stopped_at if self.sigterm_stop else None


def end_if_stopped(trainer):
    """After ``trainer.train``: end the job with ``STOPPED_STATUS`` if SIGTERM stopped training, saying how to
    resume."""
    step = trainer.stopped_at()
    if step is None:
        return
    if trainer.is_world_process_zero():
        logger.warning(
            f"Training stopped on SIGTERM at step {step} of {trainer.state.max_steps}, its checkpoint saved in "
            f"{Path(trainer.args.output_dir) / f'{PREFIX_CHECKPOINT_DIR}-{step}'}: run the same command again to "
            "resume from it."
        )
    release_process_group(STOPPED_STATUS)
    raise SystemExit(STOPPED_STATUS)
