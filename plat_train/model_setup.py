"""The model a job starts from: its config and its weights.

The config comes from a preset or config path (``--config_name``), a saved model (``--model_name_or_path``)
or the family's defaults, with ``--config_overrides`` applied on top; the weights are new, a saved p-LaT
model's, or a stock transformers GPT-2 / Llama / Qwen2 / Mistral / ViT / DeiT checkpoint's, converted to p-LaT on
load. With ``--attn_implementation plap`` a transformers checkpoint of any family keeps its own model class and
runs p-LaT in its attention layers (``modeling_plat.attention_interface``).
"""

import copy
import json
import logging

import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
)

from modeling_plat import PlatConfig, PlatConfigBase, PlatVisionConfig
from modeling_plat.attention_interface import ATTN_IMPLEMENTATION, PLAP_FIELDS, check_plap_config, mark_plap
from modeling_plat.convert import convert_to_plat, convertible, plat_config_for

from .presets import resolve_config_name
from .runs import explain_offline_errors

logger = logging.getLogger(__name__)

# What each job trains: the Auto class that loads a saved model of the task, and the p-LaT config class.
TASKS = {
    "text-generation": (AutoModelForCausalLM, PlatConfig),
    "image-classification": (AutoModelForImageClassification, PlatVisionConfig),
}


def parse_config_overrides(text):
    """'a=1,b=[1.5,2.5],c=gelu' -> {'a': 1, 'b': [1.5, 2.5], 'c': 'gelu'}.

    Commas inside brackets or braces do not split; each value is read as JSON (numbers such as 1e-2,
    lists, true/false, null), else as YAML (bare words such as gelu or euler).
    """
    pieces, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    overrides = {}
    for piece in filter(str.strip, pieces):
        key, sep, value = piece.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config_overrides entries must look like key=value; got {piece!r}")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def is_plat(config):
    return isinstance(config, PlatConfigBase)


def saved_config(model_args):
    """The config saved with ``--model_name_or_path`` (None without one): a job loads it once and passes it to
    ``build_config`` and ``load_model``."""
    if model_args.model_name_or_path is None:
        return None
    with explain_offline_errors(f"model {model_args.model_name_or_path!r}", "a local model folder"):
        return AutoConfig.from_pretrained(model_args.model_name_or_path, **model_args.hub_kwargs())


def build_config(model_args, task, saved=None, default_config_name=None, **fields):
    """The p-LaT config a job trains, with ``--config_overrides`` and ``fields`` (e.g. num_labels) applied.

    Source, first match wins: ``--config_name`` (a preset or path), ``--model_name_or_path`` (``saved``, its
    config: a p-LaT model's, or the p-LaT equivalent of a stock GPT-2 / Llama / Qwen2 / Mistral / ViT one),
    ``default_config_name``, or the task's config class with its defaults. Unknown override fields are an error.
    """
    config_class = TASKS[task][1]
    overrides = parse_config_overrides(model_args.config_overrides or "")
    if model_args.attn_implementation == ATTN_IMPLEMENTATION:
        return _interface_config(model_args, saved, overrides, fields)
    source = model_args.config_name or model_args.model_name_or_path or default_config_name
    if source is None:
        # A fresh config: defaults that depend on overridden fields (plap_p on the head count,
        # intermediate_size on hidden_size) follow them.
        _refuse_unknown(overrides, config_class())
        config = config_class(**overrides)
    else:
        if source != model_args.model_name_or_path:
            config = AutoConfig.from_pretrained(resolve_config_name(source), **model_args.hub_kwargs())
        else:
            config = copy.deepcopy(saved or saved_config(model_args))
        if convertible(config):
            config = plat_config_for(config)
        if not is_plat(config):
            raise ValueError(
                f"{source} is a {config.model_type!r} model: give a p-LaT one, or a GPT-2, Llama, Qwen2, Mistral or "
                "ViT checkpoint to convert"
            )
        if not isinstance(config, config_class):
            raise ValueError(f"{source} is a {type(config).__name__}, not the {config_class.__name__} that {task} needs")
        _refuse_unknown(overrides, config)
        for key, value in overrides.items():
            setattr(config, key, value)
    if overrides:
        logger.info(f"Overriding config: {overrides}")
    config.update(fields)
    config.validate_plat()
    return config


def _interface_config(model_args, saved, overrides, fields):
    """A transformers model's own config with p-LaT's fields: ``--model_name_or_path``'s, or ``--config_name``'s to
    train from scratch. Marked so that the saved checkpoint loads with p-LaT attention."""
    source = model_args.config_name or model_args.model_name_or_path
    if source is None:
        raise ValueError("--attn_implementation plap needs --model_name_or_path (or --config_name) of a transformers "
                         "model")
    if source == model_args.model_name_or_path:
        config = copy.deepcopy(saved or saved_config(model_args))
    else:
        config = AutoConfig.from_pretrained(resolve_config_name(source), **model_args.hub_kwargs())
    if is_plat(config):
        raise ValueError(f"{source} is a p-LaT model already: drop --attn_implementation plap, which is for "
                         "transformers' own model classes")
    _refuse_unknown(overrides, config, allowed=PLAP_FIELDS)
    for key, value in overrides.items():
        setattr(config, key, value)
    if overrides:
        logger.info(f"Overriding config: {overrides}")
    config.update(fields)
    check_plap_config(config)
    return mark_plap(config)


def _refuse_unknown(overrides, config, allowed=()):
    # Properties such as attention_bias (transformers' name for two of our fields) are settable but not saved.
    unknown = sorted(name for name in overrides if name not in allowed and name not in config.to_dict()
                     and not isinstance(getattr(type(config), name, None), property))
    if unknown:
        raise ValueError(f"--config_overrides names fields that {type(config).__name__} does not have: {unknown}")


def converted_on_load(model_args, saved):
    """Whether ``load_model`` converts ``--model_name_or_path`` (``saved`` is its config) to p-LaT: a stock checkpoint
    without ``--attn_implementation plap``, which keeps transformers' own model class."""
    return model_args.attn_implementation is None and convertible(saved)


def load_model(model_args, config, task, saved=None, **load_kwargs):
    """The model to train: ``--model_name_or_path``'s weights (converted if stock; ``saved`` is its config) in
    ``config``, or a new model.

    ``load_kwargs`` go to ``from_pretrained`` (e.g. ``ignore_mismatched_sizes``; for a stock checkpoint also
    ``num_labels`` / ``id2label``, so that transformers resizes its head before the conversion).
    """
    auto_class = TASKS[task][0]
    attention = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    if model_args.model_name_or_path is None:
        model = auto_class.from_config(config, **attention)
        size = sum(p.numel() for p in model.parameters())
        logger.info(f"Training a new {type(model).__name__} from scratch: {size / 1e6:.2f}M parameters")
        return model
    hub_kwargs = model_args.hub_kwargs()
    if model_args.dtype is not None:
        hub_kwargs["dtype"] = model_args.dtype
    if not converted_on_load(model_args, saved or saved_config(model_args)):
        return auto_class.from_pretrained(model_args.model_name_or_path, config=config, **hub_kwargs, **attention,
                                          **load_kwargs)  # fmt: skip
    source = auto_class.from_pretrained(model_args.model_name_or_path, **hub_kwargs, **load_kwargs)
    logger.info(f"Converting {type(source).__name__} from {model_args.model_name_or_path} to p-LaT "
                f"(p per head: {config.p_per_layer()[0]})")
    return convert_to_plat(source, config=config)
