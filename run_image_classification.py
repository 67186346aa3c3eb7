#!/usr/bin/env python
"""Train or fine-tune a p-LaT (or softmax-attention) vision transformer for image classification.

Offline by default: with no data flag it trains on Fashion-MNIST read from the Debian package
`dataset-fashion-mnist`. Other data: `--train_dir/--validation_dir` (one subfolder per class) or
`--dataset_name` (the Hub). DeiT's recipe (random resized crop, flip, RandAugment, random erasing,
Mixup/CutMix, label smoothing, AdamW with warm-up and cosine decay, EMA) is available by flags; see
docs/image_classification.md for the paper's ImageNet commands.

    python run_image_classification.py --config_name plat-fmnist-tiny --output_dir /tmp/plat-fmnist --do_train --do_eval

Runs under `python`, `torchrun` and `accelerate launch`; one .json/.yaml file may replace the flags.
"""

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageClassification,
    HfArgumentParser,
    ViTImageProcessorPil,
)

from modeling_plat import PlatConfig  # importing modeling_plat registers p-LaT with the Auto classes
from plat_train import image_data
from plat_train.augment import MixupCutmix, TrainTransform
from plat_train.common import (
    PlatTrainingArguments,
    detect_last_checkpoint,
    explain_offline_errors,
    parse_args,
    record_metrics,
    resolve_config_name,
    setup_logging,
)
from plat_train.ema import ModelEmaCallback
from plat_train.image_processing_plat import PlatImageProcessor
from plat_train.image_trainer import ImageClassificationTrainer, accuracy_metrics, top_k_indices

logger = logging.getLogger(__name__)
# So that fine-tuning a saved grayscale model reads its processor without running the folder's remote copy.
AutoImageProcessor.register(PlatConfig, image_processor_classes={"pil": PlatImageProcessor}, exist_ok=True)

DEFAULT_PRESET = "plat-fmnist-tiny"
IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A saved p-LaT image classifier (folder or Hub id) to fine-tune."}
    )
    config_name: str | None = field(
        default=None,
        metadata={"help": f"A preset in configuration/ (e.g. plat-deit-tiny) or a config path, to train from "
                          f"scratch. Default when no model is given: {DEFAULT_PRESET}."},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Comma-separated key=value config overrides, values in JSON: "
                          "'plap_p=[1.5,2.5,2.5],hidden_dropout_prob=0.1,image_size=32'."},
    )
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Reinitialise the classifier when num_labels differs from the saved model."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Cache for Hub models and datasets."})
    model_revision: str = field(default="main", metadata={"help": "Model version (branch, tag or commit)."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models or datasets."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom code from the Hub."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset (needs network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of --dataset_name."})
    train_dir: str | None = field(default=None, metadata={"help": "Training images, one subfolder per class."})
    validation_dir: str | None = field(default=None, metadata={"help": "Validation images, same layout."})
    fashion_mnist_dir: str = field(
        default=image_data.FASHION_MNIST_DIR,
        metadata={"help": "Fashion-MNIST idx files, the default data when neither --dataset_name nor --train_dir."},
    )
    image_column_name: str = field(default="image", metadata={"help": "Image column of --dataset_name."})
    label_column_name: str = field(default="label", metadata={"help": "Label column of --dataset_name."})
    train_val_split: float = field(
        default=0.1, metadata={"help": "Fraction of train held out for validation when there is no validation split."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate train (debugging, quick runs)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate validation and test."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for checking images."})


@dataclass
class AugmentArguments:
    crop_scale_min: float = field(default=0.08, metadata={"help": "Random resized crop: smallest area fraction."})
    hflip_prob: float = field(default=0.5, metadata={"help": "Horizontal flip probability."})
    rand_augment_ops: int = field(default=0, metadata={"help": "RandAugment ops per image (DeiT: 2; 0 = off)."})
    rand_augment_magnitude: float = field(default=9.0, metadata={"help": "RandAugment magnitude, 0-10 (DeiT: 9)."})
    rand_augment_magnitude_std: float = field(default=0.5, metadata={"help": "Noise on the magnitude (DeiT: 0.5)."})
    random_erase_prob: float = field(default=0.0, metadata={"help": "Random erasing probability (DeiT: 0.25)."})
    mixup_alpha: float = field(default=0.0, metadata={"help": "Mixup Beta(alpha, alpha) (DeiT: 0.8; 0 = off)."})
    cutmix_alpha: float = field(default=0.0, metadata={"help": "CutMix Beta(alpha, alpha) (DeiT: 1.0; 0 = off)."})
    mixup_prob: float = field(default=1.0, metadata={"help": "Probability of mixing a batch at all."})
    mixup_switch_prob: float = field(default=0.5, metadata={"help": "Probability of CutMix when both are on."})
    eval_crop_pct: float = field(
        default=1.0, metadata={"help": "Eval view: resize the short side to size / crop_pct, centre crop (DeiT: 0.875)."}
    )
    image_mean: list[float] | None = field(default=None, metadata={"help": "Per-channel mean (default: by data)."})
    image_std: list[float] | None = field(default=None, metadata={"help": "Per-channel std (default: by data)."})
    model_ema: bool = field(default=False, metadata={"help": "Keep an EMA of the weights; evaluate and save it too."})
    model_ema_decay: float = field(default=0.99996, metadata={"help": "EMA decay per optimizer step (DeiT)."})


def parse_overrides(text):
    """'a=1,b=[1.5,2.5],c=gelu' -> {'a': 1, 'b': [1.5, 2.5], 'c': 'gelu'}: commas inside brackets do not split."""
    pairs, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            pairs.append(current)
            current = ""
        else:
            current += char
    pairs.append(current)
    overrides = {}
    for pair in filter(str.strip, pairs):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--config_overrides entries must be key=value; got {pair!r}")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value.strip()
    return overrides


def load_raw_datasets(data_args, model_args, seed):
    if data_args.dataset_name is not None:
        with explain_offline_errors(f"dataset {data_args.dataset_name!r}", "--train_dir / --validation_dir"):
            raw = image_data.load_hub_dataset(
                data_args.dataset_name, data_args.dataset_config_name, data_args.image_column_name,
                data_args.label_column_name, cache_dir=model_args.cache_dir, token=model_args.token,
            )
    elif data_args.train_dir is not None:
        raw = image_data.load_image_folders(
            data_args.train_dir, data_args.validation_dir, num_proc=data_args.preprocessing_num_workers
        )
    else:
        raw = image_data.load_fashion_mnist(data_args.fashion_mnist_dir)
    return image_data.with_validation_split(raw, data_args.train_val_split, seed)


def load_model(model_args, labels):
    """The classifier to train, its labels set: a saved p-LaT to fine-tune, or a new one from a config."""
    id2label = dict(enumerate(labels))
    label2id = {name: i for i, name in id2label.items()}
    hub_kwargs = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision,
                  "token": model_args.token, "trust_remote_code": model_args.trust_remote_code}
    if model_args.model_name_or_path is not None:
        with explain_offline_errors(f"model {model_args.model_name_or_path!r}", "a local model folder"):
            config = AutoConfig.from_pretrained(model_args.model_name_or_path, **hub_kwargs)
        if config.num_labels != len(labels) and not model_args.ignore_mismatched_sizes:
            raise ValueError(
                f"{model_args.model_name_or_path} classifies {config.num_labels} labels but the data have "
                f"{len(labels)}; pass --ignore_mismatched_sizes to replace its classifier with a new one"
            )
        config.update({"num_labels": len(labels), "id2label": id2label, "label2id": label2id,
                       **parse_overrides(model_args.config_overrides or "")})
        config.validate_plat()
        return AutoModelForImageClassification.from_pretrained(
            model_args.model_name_or_path, config=config,
            ignore_mismatched_sizes=model_args.ignore_mismatched_sizes, **hub_kwargs,
        )
    config_name = resolve_config_name(model_args.config_name or DEFAULT_PRESET)
    config = AutoConfig.from_pretrained(config_name, num_labels=len(labels), id2label=id2label, label2id=label2id)
    config.update(parse_overrides(model_args.config_overrides or ""))
    config.validate_plat()
    return AutoModelForImageClassification.from_config(config)


def build_image_processor(model_args, aug_args, config, is_fashion_mnist):
    """The evaluation preprocessing, saved with the model so AutoImageProcessor and pipelines reproduce it.

    Fine-tuning keeps a saved model's mean/std unless given; grayscale models get PlatImageProcessor,
    which folds the RGB that pipelines hand over back to one channel."""
    saved = None
    if model_args.model_name_or_path is not None:
        try:
            saved = AutoImageProcessor.from_pretrained(
                model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code,
                cache_dir=model_args.cache_dir, revision=model_args.model_revision, token=model_args.token,
            )
        except (OSError, ValueError):
            saved = None
    if config.num_channels == 1:
        default_mean, default_std = (image_data.FASHION_MNIST_MEAN, image_data.FASHION_MNIST_STD) \
            if is_fashion_mnist else ([0.5], [0.5])
    else:
        default_mean, default_std = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    mean = aug_args.image_mean or (saved.image_mean if saved is not None else default_mean)
    std = aug_args.image_std or (saved.image_std if saved is not None else default_std)
    if len(mean) != config.num_channels or len(std) != config.num_channels:
        raise ValueError(
            f"image_mean {mean} and image_std {std} need one value per channel (num_channels={config.num_channels})"
        )
    size = config.image_size
    kwargs = {
        "size": {"shortest_edge": math.floor(size / aug_args.eval_crop_pct)},
        "do_center_crop": True,
        "crop_size": {"height": size, "width": size},
        "resample": 3,  # bicubic, as DeiT
        "image_mean": list(mean),
        "image_std": list(std),
    }
    if config.num_channels == 1:
        return PlatImageProcessor(do_grayscale=True, **kwargs)
    return ViTImageProcessorPil(**kwargs)


def image_mode(num_channels):
    if num_channels not in (1, 3):
        raise ValueError(f"Images can feed models with 1 (grayscale) or 3 (RGB) channels; got {num_channels}")
    return "L" if num_channels == 1 else "RGB"


def attach_transforms(splits, image_processor, aug_args, config):
    mode = image_mode(config.num_channels)
    train_transform = TrainTransform(
        config.image_size, image_processor.image_mean, image_processor.image_std,
        crop_scale=(aug_args.crop_scale_min, 1.0), hflip_prob=aug_args.hflip_prob,
        rand_augment_ops=aug_args.rand_augment_ops, rand_augment_magnitude=aug_args.rand_augment_magnitude,
        rand_augment_magnitude_std=aug_args.rand_augment_magnitude_std, erase_prob=aug_args.random_erase_prob,
    )

    def train_batch(batch):
        pixels = [train_transform(image.convert(mode)) for image in batch["image"]]
        return {"pixel_values": pixels, "labels": batch["label"]}

    def eval_batch(batch):
        images = [image.convert(mode) for image in batch["image"]]
        pixels = image_processor(images, return_tensors="pt").pixel_values
        return {"pixel_values": list(pixels), "labels": batch["label"]}

    for name, split in splits.items():
        split.set_transform(train_batch if name == "train" else eval_batch)


def collate(examples):
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["labels"] for example in examples]),
    }


def main(args=None):
    parser = HfArgumentParser((ModelArguments, DataArguments, AugmentArguments, PlatTrainingArguments))
    model_args, data_args, aug_args, training_args = parse_args(parser, args)
    # The transforms read the raw "image" column, which Trainer would drop as unused by the model.
    training_args.remove_unused_columns = False
    setup_logging(training_args)
    logger.warning(
        f"Process rank {training_args.process_index}, device {training_args.device}, "
        f"n_gpu {training_args.n_gpu}, distributed {training_args.parallel_mode.value}, "
        f"bf16 {training_args.bf16}, fp16 {training_args.fp16}"
    )
    last_checkpoint = detect_last_checkpoint(training_args)
    transformers.set_seed(training_args.seed)

    with training_args.main_process_first(desc="loading data"):
        raw = load_raw_datasets(data_args, model_args, training_args.seed)
    labels = image_data.label_names(raw["train"])
    model = load_model(model_args, labels)
    is_fashion_mnist = data_args.dataset_name is None and data_args.train_dir is None
    image_processor = build_image_processor(model_args, aug_args, model.config, is_fashion_mnist)

    splits = {}
    if training_args.do_train:
        splits["train"] = raw["train"].shuffle(seed=training_args.seed)
        if data_args.max_train_samples is not None:
            splits["train"] = splits["train"].select(range(min(data_args.max_train_samples, len(splits["train"]))))
    if training_args.do_eval:
        for name in ("validation", "test"):
            if name in raw:
                split = raw[name]
                if data_args.max_eval_samples is not None:
                    split = split.shuffle(seed=training_args.seed).select(
                        range(min(data_args.max_eval_samples, len(split)))
                    )
                splits[name] = split
    attach_transforms(splits, image_processor, aug_args, model.config)

    mixup = None
    if aug_args.mixup_alpha > 0 or aug_args.cutmix_alpha > 0:
        mixup = MixupCutmix(len(labels), aug_args.mixup_alpha, aug_args.cutmix_alpha,
                            aug_args.mixup_prob, aug_args.mixup_switch_prob)
    ema = None
    if aug_args.model_ema:
        ema = ModelEmaCallback(aug_args.model_ema_decay, resume_from_checkpoint=last_checkpoint)
    trainer = ImageClassificationTrainer(
        model=model,
        args=training_args,
        train_dataset=splits.get("train"),
        eval_dataset=splits.get("validation"),
        data_collator=collate,
        processing_class=image_processor,
        compute_metrics=accuracy_metrics,
        preprocess_logits_for_metrics=top_k_indices,
        callbacks=[ema] if ema is not None else None,
        mixup=mixup,
    )

    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=last_checkpoint)
        trainer.save_model()
        record_metrics(trainer, "train", result.metrics)
        trainer.save_state()

    if training_args.do_eval:
        evaluate_splits(trainer, splits, prefix="")
        if ema is not None:
            ema.swap_into(trainer.model)
            evaluate_splits(trainer, splits, prefix="ema_")
            if training_args.do_train:
                trainer.save_model(os.path.join(training_args.output_dir, "ema"))
            ema.swap_into(trainer.model)

    card = {"finetuned_from": model_args.model_name_or_path, "tasks": "image-classification",
            "tags": ["image-classification", "plat"]}
    if data_args.dataset_name is not None:
        card["dataset"] = data_args.dataset_name
    elif data_args.train_dir is None:
        card["dataset"] = "zalando-datasets/fashion_mnist"
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    elif training_args.do_train:
        trainer.create_model_card(**card)


def evaluate_splits(trainer, splits, prefix):
    for name in ("validation", "test"):
        if name in splits:
            metrics = trainer.evaluate(splits[name], metric_key_prefix=f"{prefix}{'eval' if name == 'validation' else name}")
            record_metrics(trainer, f"{prefix}{name}", metrics)


if __name__ == "__main__":
    main()
