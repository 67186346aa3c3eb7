"""Presets shipped with the package: model configs, training recipes and Accelerate configs, found by name.

Names follow ``<variant>-<size>``: ``plat-ptb-tiny`` is the p-LaT model, ``softmax-ptb-tiny`` its twin with
p = 2 (softmax attention) and nothing else changed. In ``presets/``:

- ``<name>.json``: a model config (``--config_name plat-ptb-tiny``);
- ``<name>.yaml``: a training recipe, the scripts' arguments in one file (``run_clm.py plat-ptb-tiny.yaml``);
- ``accelerate/<name>.yaml``: an ``accelerate launch --config_file`` (``python -m plat_train.presets
  accelerate/multi-gpu`` prints its path).

``python -m plat_train.presets`` lists them all with their sizes.
"""

import argparse
import json
from pathlib import Path

PRESET_DIR = Path(__file__).resolve().parent / "presets"
KINDS = {".json": "model config", ".yaml": "training recipe"}


def preset_path(name, suffix):
    """The shipped preset ``name`` (with or without ``suffix``), or None when there is none."""
    path = PRESET_DIR / f"{name.removesuffix(suffix)}{suffix}"
    return path if path.is_file() else None


def preset_names(suffix, folder=""):
    return sorted(str(p.relative_to(PRESET_DIR).with_suffix("")) for p in (PRESET_DIR / folder).glob(f"*{suffix}"))


def resolve_preset(name, suffix, flag):
    """A path that exists as given, else the shipped preset of that name; an error listing presets otherwise."""
    if name is None or Path(name).exists():
        return name
    path = preset_path(name, suffix)
    if path is not None:
        return str(path)
    raise ValueError(f"{flag} {name!r} is neither a path nor a preset; presets: {', '.join(preset_names(suffix))}")


def resolve_config_name(name):
    """``--config_name``: a model preset's short name (``plat-ptb-tiny``) or any path ``from_pretrained`` reads."""
    return resolve_preset(name, ".json", "--config_name")


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
    parser.add_argument("name", nargs="?", help="print this preset's path (e.g. accelerate/multi-gpu)")
    args = parser.parse_args(argv)
    if args.name is not None:
        for suffix in (".json", ".yaml"):
            path = preset_path(args.name, suffix)
            if path is not None:
                print(path)
                return
        parser.error(f"no preset named {args.name!r}")
    for name in preset_names(".json"):
        print(f"{name:28s} model config     {describe(PRESET_DIR / f'{name}.json')}")
    for name in preset_names(".yaml") + preset_names(".yaml", "accelerate"):
        kind = "accelerate config" if name.startswith("accelerate") else "training recipe"
        print(f"{name:28s} {kind}")


if __name__ == "__main__":
    main()
