"""Configurations a user picks by name: model configs, training recipes and Accelerate configs.

They live in the repository's top-level ``configuration/`` (its README says what each is for and costs) and ship
inside this package as ``plat_train/configuration/``, so that names resolve from any directory:

- ``models/<name>.json``: a model config (``--config_name plat-ptb-tiny``);
- ``recipes/<name>.yaml``: a training recipe, the scripts' arguments in one file (``run_clm.py plat-ptb-tiny.yaml``);
- ``accelerate/<name>.yaml``: an ``accelerate launch --config_file`` (``python -m plat_train.presets
  accelerate/multi-gpu`` prints its path);
- ``processors/<name>.json``: the image preprocessing that the image model preset ``<name>`` was made for (the
  mean and std of its data), which the image job takes when it builds that preset.

Names follow ``<variant>-<size>``: ``plat-ptb-tiny`` is the p-LaT model, ``softmax-ptb-tiny`` its twin with
p = 2 (softmax attention). ``python -m plat_train.presets`` lists them all with their sizes.
"""

import argparse
import json
from pathlib import Path

# Installed from a wheel, the folder sits inside the package; in a checkout (and an editable install) it is the
# repository's own.
_PACKAGED = Path(__file__).resolve().parent / "configuration"
CONFIGURATION_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[1] / "configuration"
# What each kind of name means: its folder and file suffix.
KINDS = {"model config": ("models", ".json"), "training recipe": ("recipes", ".yaml"),
         "accelerate config": ("accelerate", ".yaml"), "image processor": ("processors", ".json")}


def preset_path(name, kind):
    """The shipped configuration ``name`` (with or without its suffix) of ``kind``, or None when there is none."""
    folder, suffix = KINDS[kind]
    path = CONFIGURATION_DIR / folder / f"{name.removesuffix(suffix)}{suffix}"
    return path if path.is_file() else None


def preset_names(kind):
    folder, suffix = KINDS[kind]
    return sorted(path.stem for path in (CONFIGURATION_DIR / folder).glob(f"*{suffix}"))


def resolve_preset(name, kind, flag):
    """A path that exists as given, else the shipped configuration of that name; an error listing them otherwise."""
    if name is None or Path(name).exists():
        return name
    path = preset_path(name, kind)
    if path is not None:
        return str(path)
    raise ValueError(f"{flag} {name!r} is neither a path nor a shipped {kind}; those are: "
                     f"{', '.join(preset_names(kind))}")


def image_processor_preset(model_preset):
    """The image processor settings shipped for a model preset, given by name or path; {} for any other config
    and for a preset without them."""
    given = Path(model_preset)
    if given.exists() and given.resolve().parent != (CONFIGURATION_DIR / "models").resolve():
        return {}
    path = preset_path(given.name, "image processor")
    return json.loads(path.read_text()) if path is not None else {}


def resolve_config_name(name):
    """``--config_name``: a model preset's short name (``plat-ptb-tiny``) or any path ``from_pretrained`` reads."""
    return resolve_preset(name, "model config", "--config_name")


def describe(path):
    """One line about a model preset: family, layers x width, heads, p per head and parameter count."""
    import torch
    from transformers import AutoConfig, AutoModel

    import modeling_plat  # noqa: F401  registers the p-LaT configs

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModel.from_config(config).parameters())
    fields = json.loads(Path(path).read_text())
    family = "vision" if "image_size" in fields else "text"
    return (f"{family}, {config.num_hidden_layers} x {config.hidden_size}, {config.num_attention_heads} heads, "
            f"p = {fields.get('plap_p')}, {parameters / 1e6:.2f}M parameters in the trunk")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m plat_train.presets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="print this configuration's path (e.g. plat-ptb-tiny.yaml, "
                                                "accelerate/multi-gpu)")
    args = parser.parse_args(argv)
    if args.name is not None:
        folder, _, name = args.name.rpartition("/")
        for kind, (kind_folder, _) in KINDS.items():
            path = preset_path(name, kind) if folder in ("", kind_folder) else None
            if path is not None:
                print(path)
                return
        parser.error(f"no configuration named {args.name!r}")
    for name in preset_names("model config"):
        print(f"{name:32s} model config       {describe(CONFIGURATION_DIR / 'models' / f'{name}.json')}")
    for kind in ("training recipe", "accelerate config", "image processor"):
        folder, suffix = KINDS[kind]
        for name in preset_names(kind):
            shown = f"{name}.yaml" if kind == "training recipe" else f"{folder}/{name}"
            print(f"{shown:32s} {kind}")


if __name__ == "__main__":
    main()
