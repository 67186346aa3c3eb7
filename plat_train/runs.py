"""What every training job does around its Trainer: refusing a launch that could not train as one job, logging
like the transformers examples, resuming from the last complete checkpoint, recording metrics, clear messages when
the Hub is needed but unreachable, and ending the processes of a distributed run cleanly."""

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import datasets
import huggingface_hub
import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import strtobool

logger = logging.getLogger(__name__)


def check_launch(training_args):
    """Refuse, before any work, a multi-process launch whose processes would not train as one job.

    torchrun and ``accelerate launch`` set WORLD_SIZE / LOCAL_WORLD_SIZE. Without a GPU and without --use_cpu,
    each process would fall back to training alone as rank 0 into the same output_dir; with more processes than
    GPUs on a machine, the extra ones would have no device.
    """
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    use_cpu = training_args.use_cpu or strtobool(os.environ.get("ACCELERATE_USE_CPU", "false"))
    if processes <= 1 or use_cpu:
        return
    accelerator = getattr(torch, "accelerator", torch.cuda)  # torch.accelerator from torch 2.6
    if not accelerator.is_available():
        raise ValueError(
            f"{processes} processes were launched for one job, but this machine has no GPU, so each would train "
            "alone as rank 0 into the same output_dir. To train on CPU processes joined over gloo, pass --use_cpu "
            "(e.g. with the cpu-2-processes Accelerate config); otherwise launch one process, or run on GPUs."
        )
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    if local_processes > accelerator.device_count():
        raise ValueError(
            f"{local_processes} processes were launched on this machine but it has {accelerator.device_count()} "
            "GPU(s): launch one process per GPU (accelerate's num_processes, torchrun's --nproc_per_node)."
        )


def setup_logging(training_args):
    """Log like the transformers examples: main process at the requested level, the others at warnings."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logging.getLogger().setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    if training_args.disable_tqdm:  # Trainer's own bars follow the flag; these are the libraries' bars
        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    logger.warning(
        f"Process rank {training_args.process_index}, device {training_args.device}, n_gpu {training_args.n_gpu}, "
        f"distributed {training_args.parallel_mode.value}, bf16 {training_args.bf16}, fp16 {training_args.fp16}"
    )
    logger.info(f"Training/evaluation parameters {training_args}")


# Metric (and results file) prefix of each evaluation split, as in the transformers examples.
EVAL_PREFIXES = {"validation": "eval", "test": "test"}


def evaluation_splits(training_args, available, how_to_add):
    """The splits a job scores, by metric prefix: --do_eval the validation split and, when there is one, the test
    split; --do_predict the test split. A split that --do_train / --do_eval / --do_predict needs and the data
    (``available`` split names) lack is refused before any work; ``how_to_add`` says how to give one."""
    needs = {"train": training_args.do_train, "validation": training_args.do_eval, "test": training_args.do_predict}
    for name, flag in zip(needs, ("--do_train", "--do_eval", "--do_predict")):
        if needs[name] and name not in available:
            raise ValueError(f"{flag} needs a {name} split, which the data lack: {how_to_add}")
    scored = ("validation", "test") if training_args.do_eval else ("test",) if training_args.do_predict else ()
    return {EVAL_PREFIXES[name]: name for name in scored if name in available}


class HubUnreachableError(ConnectionError):
    """The Hugging Face Hub was needed (a dataset, model or tokenizer name) but could not be reached."""


@contextlib.contextmanager
def explain_offline_errors(what, local_alternative):
    """Turn the Hub's connection / offline-mode errors raised inside the block into one clear message.

    ``what`` names the thing being fetched (``"dataset 'wikitext'"``); ``local_alternative`` tells the user
    how to pass the same thing from local files (``"--train_file / --validation_file"``).
    """
    try:
        yield
    # OfflineModeIsEnabled is a ConnectionError; a cache miss while offline is a LocalEntryNotFoundError.
    except (ConnectionError, huggingface_hub.errors.LocalEntryNotFoundError) as error:
        if isinstance(error, HubUnreachableError):
            raise
        raise HubUnreachableError(
            f"Could not load {what}: the Hugging Face Hub is unreachable or offline mode is on "
            f"({type(error).__name__}: {error}). Without network, pass {local_alternative} instead, or run once "
            "with network so that it is cached."
        ) from error


# What a run leaves in its output_dir before its first finished checkpoint, beside unfinished checkpoint folders:
# TensorBoard's logs (transformers' default logging folder).
EARLY_LEFTOVERS = ("runs",)


def checkpoint_folders(output_dir):
    """The ``checkpoint-N`` folders in ``output_dir``, newest first."""
    found = []
    for folder in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        step = folder.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if folder.is_dir() and step.isdigit():
            found.append((int(step), folder))
    return [folder for _, folder in sorted(found, reverse=True)]


def finished_state(path):
    """Whether ``path`` holds a whole trainer state: a JSON object (json.dumps writes its closing brace last)."""
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (OSError, ValueError):  # missing; empty, cut short or not text (JSONDecodeError, UnicodeDecodeError)
        return False


def unfinished_reason(folder, required=()):
    """Why the checkpoint ``folder`` cannot be resumed from, or None. Trainer writes ``trainer_state.json`` last, in
    place: a folder without it, or with one that is empty or cut short, is what a run killed while saving leaves
    behind. ``required`` names files that callbacks write after it (``ema.EMA_WEIGHTS_NAME``)."""
    if not finished_state(folder / "trainer_state.json"):
        return "its trainer_state.json is missing or cut short, so its save did not finish"
    missing = [name for name in required if not (folder / name).is_file()]
    return f"it has no {', '.join(missing)} (its save did not finish, or ran without it)" if missing else None


def last_complete_checkpoint(output_dir, required=()):
    """The newest ``checkpoint-N`` folder in ``output_dir`` that can be resumed from (``unfinished_reason``), or None.

    Unfinished folders are skipped with a warning: resuming from one would fail on its state, or load a
    half-written checkpoint.
    """
    for folder in checkpoint_folders(output_dir):
        reason = unfinished_reason(folder, required)
        if reason is None:
            return str(folder)
        logger.warning(f"Skipping {folder}: {reason}")
    return None


def detect_last_checkpoint(training_args, required=()):
    """The checkpoint to resume from, following the transformers examples.

    An explicit ``--resume_from_checkpoint`` wins, checked before any work: it must be a checkpoint folder whose save
    finished (``unfinished_reason``; one without the files ``required`` is taken, their callbacks starting afresh).
    Otherwise, when training into an ``output_dir`` that already holds ``checkpoint-*`` folders, the newest finished
    one (``last_complete_checkpoint``, with the files ``required`` beside Trainer's) is returned (and logged) unless
    ``--overwrite_output_dir`` (an ``arguments.PlatTrainingArguments`` field; plain ``TrainingArguments`` count as
    False). Without one, a folder that holds only what a run stopped before its first finished checkpoint leaves
    (unfinished checkpoints, ``EARLY_LEFTOVERS``) is trained into from the start, so that the same command runs
    again; any other non-empty ``output_dir`` raises, so that a finished run is not silently overwritten. Returns
    None when training starts from scratch.
    """
    overwrite_output_dir = getattr(training_args, "overwrite_output_dir", False)
    if training_args.resume_from_checkpoint is not None:
        folder = Path(training_args.resume_from_checkpoint)
        reason = "there is no such folder" if not folder.is_dir() else unfinished_reason(folder)
        if reason is not None:
            raise ValueError(
                f"--resume_from_checkpoint {folder} cannot be resumed from: {reason}. Give a checkpoint-N folder of a "
                "run, or leave the flag out to resume from the newest finished checkpoint in --output_dir."
            )
        return training_args.resume_from_checkpoint
    output_dir = Path(training_args.output_dir)
    if not training_args.do_train or overwrite_output_dir or not output_dir.is_dir():
        return None
    last_checkpoint = last_complete_checkpoint(output_dir, required)
    if last_checkpoint is not None:
        logger.info(
            f"Checkpoint detected, resuming training at {last_checkpoint}. To avoid this behaviour, change "
            "--output_dir or pass --overwrite_output_dir to train from scratch."
        )
        return last_checkpoint
    unfinished = [folder for folder in checkpoint_folders(output_dir)
                  if not finished_state(folder / "trainer_state.json")]  # fmt: skip
    left = set(output_dir.iterdir()) - set(unfinished)
    if any(path.name not in EARLY_LEFTOVERS for path in left):
        raise ValueError(
            f"Output directory ({output_dir}) already exists and is not empty. Use --overwrite_output_dir to "
            "train into it anyway, or --resume_from_checkpoint to continue a run."
        )
    if unfinished or left:
        logger.warning(
            f"{output_dir} holds no finished checkpoint, only what a run stopped before its first one leaves: "
            "training from the start."
        )
    return None


def record_metrics(trainer, split, metrics):
    """Log ``metrics`` and merge them into ``<output_dir>/{split}_results.json`` and ``all_results.json``.

    Keys should already carry the split's prefix (``eval_``, ``test_``, ``train_``) so that
    ``all_results.json`` keeps every split apart; only the main process writes. Numbers that Trainer has not
    logged itself (perplexities, sliding-window and unigram metrics, EMA results) go through ``trainer.log``, so
    that they reach the trackers of ``--report_to`` (TensorBoard, W&B, ...) too.
    """
    logged = trainer.state.log_history[-1] if trainer.state.log_history else {}
    new = {name: value for name, value in metrics.items()
           if name not in logged and isinstance(value, (int, float)) and not isinstance(value, bool)}
    if new:
        trainer.log(new)
    trainer.log_metrics(split, metrics)
    trainer.save_metrics(split, metrics)


def publish(trainer, card, push_to_hub):
    """Push the output folder to the Hub with its model card, or write the card locally; then end the job."""
    if push_to_hub:
        trainer.push_to_hub(**card)
    else:
        trainer.create_model_card(**card)
    release_process_group()


def release_process_group(status=0):
    """End a distributed job whose processes all got here: every process waits for the others, then leaves with
    ``status`` without the interpreter's teardown.

    When the job's objects are freed, the last reference to gloo's process group (held by the DDP model) joins
    gloo's worker threads while holding the GIL; a worker that is still freeing finished work that references
    Python tensors needs the GIL too, and the process hangs (or aborts with "terminate called without an active
    exception" if the interpreter is already shutting down), after the outputs are written. Destroying the group
    does not stop those threads, so once every output is on disk the processes exit directly with their streams and
    logs flushed. Not done after an error: a peer may still wait in a collective.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
