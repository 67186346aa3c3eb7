r"""Command line: convert a transformers GPT-2 / Llama / Qwen2 / Mistral / ViT / DeiT checkpoint to p-LaT and save it,
with its tokenizer or image processor and a model card. The library function is
``modeling_plat.convert.convert_to_plat``.

    plat-convert --source facebook/deit-tiny-patch16-224 --output plat-deit-tiny-init \
        --config_overrides "plap_p=[1.5,1.5,2.5]"
    plat-convert --source HuggingFaceTB/SmolLM2-135M --output plat-smollm2-135m-init
"""

import argparse
import sys
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer
# The class itself: in transformers 5.17 the top-level name is a placeholder needing torchvision, which nothing here
# needs (modeling_plat/__init__.py says more).
from transformers.models.auto.image_processing_auto import AutoImageProcessor

from modeling_plat.convert import convert_to_plat, plat_config_for

from .arguments import ModelArguments
from .model_cards import current_command, write_model_card
from .model_setup import build_config

# The job whose config a source family converts to, and what carries its preprocessing.
TEXT, VISION = ("text-generation", AutoTokenizer), ("image-classification", AutoImageProcessor)
FAMILIES = {"gpt2": TEXT, "llama": TEXT, "qwen2": TEXT, "mistral": TEXT, "vit": VISION}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="plat-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True,
                        help="path or hub id of a GPT-2, Llama, Qwen2, Mistral or ViT / DeiT checkpoint")
    parser.add_argument("--output", required=True, help="folder to save the p-LaT checkpoint in")
    parser.add_argument("--config_overrides", default=None,
                        help="p-LaT config fields, e.g. 'plap_p=[1.5,1.5,2.5],plap_formulation=euler' "
                             "(default: the paper's head mix, eq. 12)")
    args = parser.parse_args(argv)

    # A source that cannot be read (no such folder, no network, not a transformers checkpoint), of a family that does
    # not convert, or overrides p-LaT refuses: argparse's error, before anything is converted or written.
    try:
        if args.source.startswith(("/", ".")) and not Path(args.source).exists():
            raise FileNotFoundError(f"--source {args.source}: no such folder")
        source_config = AutoConfig.from_pretrained(args.source)
        if source_config.model_type not in FAMILIES:
            plat_config_for(source_config)  # raises the error naming what converts
        task, processor_class = FAMILIES[source_config.model_type]
        model_args = ModelArguments(model_name_or_path=args.source, config_overrides=args.config_overrides)
        config = build_config(model_args, task)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    model = convert_to_plat(args.source, config=config)
    model.save_pretrained(args.output)
    try:
        processor_class.from_pretrained(args.source).save_pretrained(args.output)
    except (OSError, ValueError) as error:
        print(f"No {processor_class.__name__[4:]} copied from {args.source}: {error}", file=sys.stderr)
    write_model_card(args.output, model.config, task, base_model=args.source, command=current_command())
    print(f"Saved p-LaT {type(model).__name__} (p per head: {model.config.p_per_layer()[0]}) to {args.output}")


if __name__ == "__main__":
    main()
