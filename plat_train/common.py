"""Argument parsing, preset lookup and logging shared by the training scripts."""

import logging
import sys
from pathlib import Path

import datasets
import transformers

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
