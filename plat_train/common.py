"""Argument parsing, preset lookup, logging, checkpoint detection, metric files and offline-error messages
shared by the training scripts."""

import contextlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import huggingface_hub
import transformers
from transformers import TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

PRESET_DIR = Path(__file__).resolve().parent.parent / "configuration"

logger = logging.getLogger(__name__)


def parse_args(parser, args=None):
    """Parse command-line flags, or a single .json / .yaml / .yml file holding them all."""
    args = sys.argv[1:] if args is None else list(args)
    if len(args) == 1 and args[0].endswith(".json"):
        return parser.parse_json_file(json_file=Path(args[0]).resolve())
    if len(args) == 1 and args[0].endswith((".yaml", ".yml")):
        return parser.parse_yaml_file(yaml_file=Path(args[0]).resolve())
    return parser.parse_args_into_dataclasses(args=args)


def resolve_config_name(name):
    """A preset's short name (``plat-ptb-tiny``) or any path: the path that ``from_pretrained`` should read."""
    if name is None or Path(name).exists():
        return name
    preset = PRESET_DIR / f"{name.removesuffix('.json')}.json"
    if preset.is_file():
        return str(preset)
    known = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
    raise ValueError(f"--config_name {name!r} is neither a path nor a preset; presets: {', '.join(known)}")


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


@dataclass
class PlatTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus ``--overwrite_output_dir``, which transformers 5 removed but the examples'
    resume-or-refuse logic for an existing ``output_dir`` needs (see ``detect_last_checkpoint``)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train from scratch into a non-empty output_dir instead of resuming from its last checkpoint."
        },
    )


def last_complete_checkpoint(output_dir):
    """The newest ``checkpoint-N`` folder in ``output_dir`` that Trainer finished writing, or None.

    Trainer writes ``trainer_state.json`` last, so a folder without it is what a run killed while saving
    leaves behind: it is skipped (with a warning) rather than resumed from.
    """
    found = []
    for folder in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        step = folder.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if folder.is_dir() and step.isdigit():
            found.append((int(step), folder))
    for _, folder in sorted(found, reverse=True):
        if (folder / "trainer_state.json").is_file():
            return str(folder)
        logger.warning(f"Skipping {folder}: it has no trainer_state.json, so its save did not finish")
    return None


def detect_last_checkpoint(training_args):
    """The checkpoint to resume from, following the transformers examples.

    An explicit ``--resume_from_checkpoint`` wins. Otherwise, when training into an ``output_dir`` that
    already holds ``checkpoint-*`` folders, the newest one is returned (and logged) unless
    ``--overwrite_output_dir`` (a ``PlatTrainingArguments`` field; plain ``TrainingArguments`` count as
    False); a non-empty ``output_dir`` with no checkpoint raises, so that a finished run is not silently
    overwritten. Returns None when training starts from scratch.
    """
    overwrite_output_dir = getattr(training_args, "overwrite_output_dir", False)
    if training_args.resume_from_checkpoint is not None:
        return training_args.resume_from_checkpoint
    output_dir = Path(training_args.output_dir)
    if not training_args.do_train or overwrite_output_dir or not output_dir.is_dir():
        return None
    last_checkpoint = last_complete_checkpoint(output_dir)
    if last_checkpoint is None and any(output_dir.iterdir()):
        raise ValueError(
            f"Output directory ({output_dir}) already exists and is not empty. Use --overwrite_output_dir to "
            "train into it anyway, or --resume_from_checkpoint to continue a run."
        )
    if last_checkpoint is not None:
        logger.info(
            f"Checkpoint detected, resuming training at {last_checkpoint}. To avoid this behaviour, change "
            "--output_dir or pass --overwrite_output_dir to train from scratch."
        )
    return last_checkpoint


def record_metrics(trainer, split, metrics):
    """Log ``metrics`` and merge them into ``<output_dir>/{split}_results.json`` and ``all_results.json``.

    Keys should already carry the split's prefix (``eval_``, ``test_``, ``train_``) so that
    ``all_results.json`` keeps every split apart; only the main process writes.
    """
    trainer.log_metrics(split, metrics)
    trainer.save_metrics(split, metrics)
