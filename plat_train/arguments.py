"""Command-line arguments shared by the training jobs, and how they are read: flags, or a file of them.

Each job adds its own data (and model) arguments to these; ``parse_args`` reads them all.
"""

import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
import torch
import yaml
from transformers import TrainingArguments

from .model_setup import parse_config_overrides
from .presets import resolve_config_name, resolve_preset

ARGUMENT_FILES = (".json", ".yaml", ".yml")


@dataclass
class ModelArguments:
    """Which model a job starts from: a preset or config, a saved model (p-LaT or a stock one to convert)."""

    config_name: str | None = field(
        default=None,
        metadata={"help": "A model preset's short name (e.g. plat-ptb-tiny; `python -m plat_train.presets` lists "
                          "them) or a config path, to train from scratch."},
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A saved model (folder or Hub id) to fine-tune or evaluate: a p-LaT checkpoint, or a "
                          "transformers GPT-2 / Llama / Qwen2 / Mistral / ViT / DeiT one, converted to p-LaT on load."},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Comma-separated config fields to override, values in JSON (or YAML), e.g. "
                          "'plap_p=[1.5,1.5,2.5],hidden_dropout_prob=0.1,plap_formulation=euler'. Unknown fields "
                          "are an error."},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "'plap': keep --model_name_or_path's own transformers model (any family: Llama 3, Qwen3, "
                          "Gemma, Phi-3, ViT, DeiT, ...) and run p-LaT in its attention layers, p from "
                          "--config_overrides (plap_p, plap_eps, plap_formulation), instead of converting it to "
                          "PlatForCausalLM or PlatForImageClassification.",
                  "choices": ["plap"]},
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache Hub models and datasets."})
    model_revision: str = field(default="main", metadata={"help": "Model version (branch, tag or commit)."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models or datasets."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow code from the Hub (models, datasets) to run on this machine."}
    )
    dtype: str | None = field(
        default=None,
        metadata={"help": "Load a saved model in this dtype ('auto', 'bfloat16', 'float16', 'float32'); "
                          "mixed-precision training is --bf16 / --fp16.",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )

    def __post_init__(self):
        # Refused while the arguments are read (``parse_args``), not after the data: a preset's name mistyped, an
        # override that is not key=value. Unknown override fields wait for the config that defines the fields.
        resolve_config_name(self.config_name)
        parse_config_overrides(self.config_overrides or "")

    def hub_kwargs(self):
        """The keyword arguments every ``from_pretrained`` of this job takes."""
        return {"cache_dir": self.cache_dir, "revision": self.model_revision, "token": self.token,
                "trust_remote_code": self.trust_remote_code}


@dataclass
class PlatTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus ``--overwrite_output_dir``, which transformers 5 removed but the examples'
    resume-or-refuse logic for an existing ``output_dir`` needs (see ``runs.detect_last_checkpoint``), pinned
    data-loader memory only where an accelerator can use it (torch warns at every data loader otherwise),
    ``--push_to_hub`` refused with the arguments when the Hub cannot take the push (``check_hub_access``), and
    counts and seeds that Trainer would fail on later, or run as no one meant, refused with them too
    (``check_training_counts``)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train from scratch into a non-empty output_dir instead of resuming from its last checkpoint."
        },
    )

    def __post_init__(self):
        check_training_counts(self)
        super().__post_init__()
        if not accelerator_available():
            self.dataloader_pin_memory = False
        if self.push_to_hub:
            check_hub_access(self.hub_token)


# How to push a finished run's folder without --push_to_hub.
UPLOAD_LATER = "drop --push_to_hub and upload the output_dir later (hf upload <repo id> <output_dir>)"


def check_hub_access(token):
    """Refuse --push_to_hub with the arguments when the Hub cannot take the push: offline mode, no token, a token it
    refuses, no connection. Trainer would fail creating the repository after the data had loaded and the model was
    built, in a Hub client's traceback."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError(f"--push_to_hub needs the Hugging Face Hub, but offline mode is on (HF_HUB_OFFLINE): "
                         f"{UPLOAD_LATER}")  # fmt: skip
    try:
        huggingface_hub.whoami(token=token)
    except huggingface_hub.errors.LocalTokenNotFoundError as error:
        raise ValueError("--push_to_hub needs a Hugging Face token: log in (hf auth login), set HF_TOKEN or pass "
                         f"--hub_token; or {UPLOAD_LATER}") from error  # fmt: skip
    except huggingface_hub.errors.HfHubHTTPError as error:
        raise ValueError(f"--push_to_hub: the Hugging Face Hub refused the token ({error}); log in again (hf auth "
                         f"login) or pass another --hub_token") from error  # fmt: skip
    except Exception as error:  # the HTTP client's connection errors, which have no common base with the Hub's own
        raise ValueError(f"--push_to_hub needs the Hugging Face Hub, which could not be reached "
                         f"({type(error).__name__}: {error}): check the network, or {UPLOAD_LATER}") from error


def check_training_counts(arguments):
    """Refuse, while the arguments are read, the ``TrainingArguments`` values that would fail in a data loader's or
    Trainer's traceback once the data have loaded (batch sizes, accumulation steps, loader workers, the seed), or that
    Trainer would run as no one meant (``--max_steps 0`` trains one step, ``--num_train_epochs 0`` none, and either
    saves the model as a finished run's)."""
    check_minimum(arguments, 1, "per_device_train_batch_size", "per_device_eval_batch_size",
                  "gradient_accumulation_steps")  # fmt: skip
    check_minimum(arguments, 0, "dataloader_num_workers")
    if not 0 <= arguments.seed < 2**32:  # numpy's seeds, which Trainer sets
        raise ValueError(f"--seed must lie between 0 and 2**32 - 1; got {arguments.seed}")
    if arguments.max_steps == 0:
        raise ValueError("--max_steps must be at least 1, or negative to train --num_train_epochs; got 0")
    if arguments.max_steps < 0 and arguments.num_train_epochs <= 0:
        raise ValueError(f"--num_train_epochs must be above 0 unless --max_steps is given; got "
                         f"{arguments.num_train_epochs:g}")  # fmt: skip


def check_minimum(arguments, minimum, *names):
    """Refuse, while the arguments are read, any of the fields ``names`` of ``arguments`` below ``minimum`` (those
    left unset, None, pass)."""
    for name in names:
        value = getattr(arguments, name)
        if value is not None and value < minimum:
            raise ValueError(f"--{name} must be at least {minimum}; got {value}")


def accelerator_available():
    """Whether torch's data loaders find an accelerator to pin memory for (CUDA before torch 2.6)."""
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def file_flags(path):
    """The arguments of a .json / .yaml file as command-line flags, so that flags given after it override them."""
    text = Path(path).read_text()
    try:
        values = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"{path} cannot be read: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of argument names to values")
    flags = []
    for name, value in values.items():
        if value is None:
            continue
        flags.append(f"--{name}")
        if isinstance(value, (list, tuple)):
            flags += [str(item) for item in value]
        elif isinstance(value, dict):
            flags.append(json.dumps(value))
        else:
            flags.append(str(value).lower() if isinstance(value, bool) else str(value))
    return flags


def parse_args(parser, args=None):
    """Parse flags, or a .json / .yaml file of them followed by flags that override it.

    The file is a path or the name of a shipped training recipe (``plat-ptb-tiny.yaml``). Whatever the arguments get
    wrong (an unknown flag, a recipe that is missing or malformed, a model preset that is not shipped, values that
    ``TrainingArguments`` refuses) ends the job as argparse ends it for a value of the wrong type: a line on stderr and
    exit status 2, no traceback.
    """
    args = sys.argv[1:] if args is None else list(args)
    try:
        if args and args[0].endswith(ARGUMENT_FILES):
            path = args[0] if Path(args[0]).exists() or args[0].endswith(".json") else resolve_preset(
                args[0].removesuffix(".yml"), "training recipe", "The arguments file")
            if not Path(path).is_file():
                raise FileNotFoundError(f"Arguments file not found: {path}")
            args = file_flags(Path(path).resolve()) + args[1:]
        *parsed, unknown = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
        if unknown:
            raise ValueError(unknown_flags_message(parser, unknown))
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return tuple(parsed)


def unknown_flags_message(parser, unknown):
    """What argparse says of arguments it does not know, with the closest known flag to each unknown one."""
    known = [option for action in parser._actions for option in action.option_strings]
    flags = [argument.split("=")[0] for argument in unknown if argument.startswith("--")]
    hints = [f"{flag} -> {close[0]}" for flag in flags for close in [difflib.get_close_matches(flag, known, n=1)]
             if close]  # fmt: skip
    return f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean: {', '.join(hints)}?)" if hints else "")
