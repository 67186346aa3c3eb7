r"""The image-classification job: train or fine-tune a p-LaT (or softmax-attention) vision transformer with
Trainer; ``run_image_classification.py`` and the ``plat-run-image-classification`` command start it.

Offline by default: with no data flag it trains on Fashion-MNIST read from the Debian package
`dataset-fashion-mnist`. Other data: `--train_dir/--validation_dir` (one subfolder per class) or
`--dataset_name` (the Hub). DeiT's recipe (random resized crop, flip, RandAugment, random erasing,
Mixup/CutMix, label smoothing, AdamW with warm-up and cosine decay, EMA) is available by flags; see
docs/image_classification.md for the paper's ImageNet commands.

    python run_image_classification.py --config_name plat-fmnist-tiny --output_dir /tmp/plat-fmnist --do_train --do_eval
    python run_image_classification.py plat-fmnist-tiny.yaml     # a shipped recipe
    python run_image_classification.py --model_name_or_path facebook/deit-tiny-patch16-224 \
        --config_overrides "plap_p=[1.5,1.5,2.5]" --dataset_name imagenet-1k ...   # DeiT converted to p-LaT
    python run_image_classification.py --model_name_or_path facebook/deit-tiny-patch16-224 \
        --attn_implementation plap ...   # DeiT kept as transformers' class, p-LaT in its attention layers

Runs under `python`, `torchrun` and `accelerate launch`.
"""

import logging
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, ViTImageProcessorPil, set_seed
# The class itself: in transformers 5.17 the top-level name is a placeholder needing torchvision, which nothing here
# needs (modeling_plat/__init__.py says more).
from transformers.models.auto.image_processing_auto import AutoImageProcessor

from modeling_plat import PlatImageProcessor

from . import vision_data
from .arguments import ModelArguments, PlatTrainingArguments, check_minimum, parse_args
from .ema import EMA_WEIGHTS_NAME, ModelEmaCallback
from .model_cards import FASHION_MNIST_DATASET
from .model_setup import build_config, converted_on_load, load_model, saved_config
from .preemption import end_if_stopped
from .presets import image_processor_preset
from .runs import (
    check_launch,
    detect_last_checkpoint,
    evaluation_splits,
    explain_offline_errors,
    publish,
    record_metrics,
    setup_logging,
)
from .trainers import ImageClassificationTrainer
from .vision_augment import MixupCutmix, TrainTransform
from .vision_metrics import accuracy_metrics, top_k_indices

logger = logging.getLogger(__name__)
DEFAULT_PRESET = "plat-fmnist-tiny"
IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# transformers' distilled DeiT classifier, which it cannot train: a run would fail at its first evaluation.
DISTILLED_DEIT = "DeiTForImageClassificationWithTeacher"


@dataclass
class ImageModelArguments(ModelArguments):
    """The shared model arguments, plus what to do with a saved classifier of another label count."""

    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Reinitialise the classifier when num_labels differs from the saved model."}
    )


@dataclass
class ImageDataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset (needs network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of --dataset_name."})
    train_dir: str | None = field(default=None, metadata={"help": "Training images, one subfolder per class."})
    validation_dir: str | None = field(default=None, metadata={"help": "Validation images, same layout."})
    fashion_mnist_dir: str = field(
        default=vision_data.FASHION_MNIST_DIR,
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

    def __post_init__(self):
        # An empty split would fail in Trainer's sampler, after the data had loaded.
        check_minimum(self, 1, "max_train_samples", "max_eval_samples")


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
    image_mean: list[float] | None = field(
        default=None, metadata={"help": "Per-channel mean (default: the saved model's, else its preset's, else 0.5 "
                                        "grayscale / ImageNet's RGB)."}
    )
    image_std: list[float] | None = field(default=None, metadata={"help": "Per-channel std (default: as the mean)."})
    model_ema: bool = field(default=False, metadata={"help": "Keep an EMA of the weights; evaluate and save it too."})
    model_ema_decay: float = field(
        default=0.99996, metadata={"help": "EMA decay per optimizer step once warmed up (DeiT: 0.99996)."}
    )
    model_ema_warmup: bool = field(
        default=True,
        metadata={"help": "EMA warmup: step t decays by min(decay, 1 - (1 + t) ** -0.75), so that short runs forget "
                          "the initial weights; false for DeiT's fixed decay."},
    )

    def __post_init__(self):
        # Refused while the arguments are read: out of range, a probability or a fraction would be taken as it comes
        # (a flip "probability" of 2 flips every image), a negative alpha fails in the first mixed batch and an eval
        # crop of 0 when the eval transform is built.
        for name in ("hflip_prob", "random_erase_prob", "mixup_prob", "mixup_switch_prob", "model_ema_decay"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name} must lie between 0 and 1; got {getattr(self, name)}")
        for name in ("crop_scale_min", "eval_crop_pct"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"--{name} is a fraction of the image: above 0, at most 1; got {getattr(self, name)}")
        check_minimum(self, 0, "rand_augment_ops", "rand_augment_magnitude_std", "mixup_alpha", "cutmix_alpha")


def load_raw_datasets(data_args, model_args, seed):
    if data_args.dataset_name is not None:
        with explain_offline_errors(f"dataset {data_args.dataset_name!r}", "--train_dir / --validation_dir"):
            raw = vision_data.load_hub_dataset(
                data_args.dataset_name, data_args.dataset_config_name, data_args.image_column_name,
                data_args.label_column_name, cache_dir=model_args.cache_dir, token=model_args.token,
            )
    elif data_args.train_dir is not None:
        raw = vision_data.load_image_folders(
            data_args.train_dir, data_args.validation_dir, num_proc=data_args.preprocessing_num_workers
        )
    else:
        raw = vision_data.load_fashion_mnist(data_args.fashion_mnist_dir)
    return vision_data.with_validation_split(raw, data_args.train_val_split, seed)


def refuse_untrainable(model_args, saved):
    """Stop before the data load on a saved model (``saved`` is its config) that the job could not train."""
    if saved is not None and DISTILLED_DEIT in (saved.architectures or ()):
        raise ValueError(
            f"{model_args.model_name_or_path} is a distilled DeiT ({DISTILLED_DEIT}), which transformers runs for "
            "inference only (no loss; its output holds each head's logits beside their mean): fine-tune its trunk as "
            "a DeiTForImageClassification instead, saved with DeiTForImageClassification.from_pretrained(path)"
            ".save_pretrained(folder), then --model_name_or_path folder --attn_implementation plap"
        )


def build_model(model_args, saved, labels):
    """The classifier to train, its labels set: a saved p-LaT or stock ViT / DeiT to fine-tune (``saved`` is its
    config; converted, or kept in its transformers class with ``--attn_implementation plap``), or a new one from a
    preset or config (default: the Fashion-MNIST preset)."""
    id2label = dict(enumerate(labels))
    fields = {"num_labels": len(labels), "id2label": id2label, "label2id": {name: i for i, name in id2label.items()}}
    load_kwargs = {}
    if saved is not None:
        has_classifier = any(name.endswith("ForImageClassification") for name in saved.architectures or ())
        if has_classifier and saved.num_labels != len(labels) and not model_args.ignore_mismatched_sizes:
            raise ValueError(
                f"{model_args.model_name_or_path} classifies {saved.num_labels} labels but the data have "
                f"{len(labels)}; pass --ignore_mismatched_sizes to replace its classifier with a new one"
            )
        load_kwargs = {"ignore_mismatched_sizes": model_args.ignore_mismatched_sizes}
        if converted_on_load(model_args, saved):  # transformers resizes its head before the conversion
            load_kwargs.update(fields)
    default = None if model_args.model_name_or_path else DEFAULT_PRESET
    config = build_config(model_args, "image-classification", saved, default_config_name=default, **fields)
    with explain_offline_errors(f"model {model_args.model_name_or_path!r}", "a local model folder"):
        return load_model(model_args, config, "image-classification", saved, **load_kwargs)


def build_image_processor(model_args, aug_args, config):
    """The evaluation preprocessing, saved with the model so AutoImageProcessor and pipelines reproduce it.

    Mean and std: the flags, else a fine-tuned model's saved processor, else what the model preset ships
    (configuration/processors/), else 0.5 for grayscale and ImageNet's for RGB. Grayscale models get
    PlatImageProcessor, which folds the RGB that pipelines hand over back to one channel."""
    if model_args.model_name_or_path is not None:
        try:
            saved = AutoImageProcessor.from_pretrained(model_args.model_name_or_path, **model_args.hub_kwargs())
            default = {"image_mean": saved.image_mean, "image_std": saved.image_std}
        except (OSError, ValueError):
            default = {}
    else:
        default = image_processor_preset(model_args.config_name or DEFAULT_PRESET)
    if not default:
        default = ({"image_mean": [0.5], "image_std": [0.5]} if config.num_channels == 1
                   else {"image_mean": IMAGENET_DEFAULT_MEAN, "image_std": IMAGENET_DEFAULT_STD})
    mean = aug_args.image_mean or default["image_mean"]
    std = aug_args.image_std or default["image_std"]
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


def attach_transforms(train_set, eval_sets, image_processor, aug_args, config):
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

    if train_set is not None:
        train_set.set_transform(train_batch)
    for split in eval_sets.values():
        split.set_transform(eval_batch)


def collate(examples):
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["labels"] for example in examples]),
    }


def evaluate_splits(trainer, eval_sets, prefix=""):
    """Score every evaluation split (``eval_sets`` by metric prefix) and record its metrics; ``prefix`` tells the
    EMA weights' scores apart."""
    for split_prefix, dataset in eval_sets.items():
        metrics = trainer.evaluate(dataset, metric_key_prefix=f"{prefix}{split_prefix}")
        record_metrics(trainer, f"{prefix}{split_prefix}", metrics)


def model_card_fields(model_args, data_args):
    """What Trainer's model card should say about the starting point and the data."""
    card = {"finetuned_from": model_args.model_name_or_path, "tasks": "image-classification",
            "tags": ["image-classification", "plat"]}
    if data_args.dataset_name is not None:
        card["dataset"] = data_args.dataset_name
    elif data_args.train_dir is None:
        card["dataset"] = FASHION_MNIST_DATASET
    return card


def main(args=None):
    parser = HfArgumentParser((ImageModelArguments, ImageDataArguments, AugmentArguments, PlatTrainingArguments))
    model_args, data_args, aug_args, training_args = parse_args(parser, args)
    check_launch(training_args)
    # The transforms read the raw "image" column, which Trainer would drop as unused by the model.
    training_args.remove_unused_columns = False
    setup_logging(training_args)
    # With --model_ema, a checkpoint is finished once its average is saved too (after Trainer's state).
    last_checkpoint = detect_last_checkpoint(training_args, (EMA_WEIGHTS_NAME,) if aug_args.model_ema else ())
    set_seed(training_args.seed)
    saved = saved_config(model_args)
    refuse_untrainable(model_args, saved)

    # Data
    with training_args.main_process_first(desc="loading data"):
        raw = load_raw_datasets(data_args, model_args, training_args.seed)
    eval_splits = evaluation_splits(
        training_args, raw, "Fashion-MNIST and Hub datasets with a test split have one; folders have none"
    )

    # Model and image processor
    labels = vision_data.label_names(raw["train"])
    model = build_model(model_args, saved, labels)
    image_processor = build_image_processor(model_args, aug_args, model.config)

    # Datasets
    train_set = None
    if training_args.do_train:
        train_set = raw["train"].shuffle(seed=training_args.seed)
        if data_args.max_train_samples is not None:
            train_set = train_set.select(range(min(data_args.max_train_samples, len(train_set))))
    eval_sets = {}
    for prefix, name in eval_splits.items():
        eval_sets[prefix] = raw[name]
        if data_args.max_eval_samples is not None:
            eval_sets[prefix] = raw[name].shuffle(seed=training_args.seed).select(
                range(min(data_args.max_eval_samples, len(raw[name])))
            )
    attach_transforms(train_set, eval_sets, image_processor, aug_args, model.config)

    mixup = None
    if aug_args.mixup_alpha > 0 or aug_args.cutmix_alpha > 0:
        mixup = MixupCutmix(len(labels), aug_args.mixup_alpha, aug_args.cutmix_alpha,
                            aug_args.mixup_prob, aug_args.mixup_switch_prob)
    ema = None
    if aug_args.model_ema:
        ema = ModelEmaCallback(aug_args.model_ema_decay, aug_args.model_ema_warmup,
                               resume_from_checkpoint=last_checkpoint)
    trainer = ImageClassificationTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_sets.get("eval"),
        data_collator=collate,
        processing_class=image_processor,
        compute_metrics=accuracy_metrics,
        preprocess_logits_for_metrics=top_k_indices,
        callbacks=[ema] if ema is not None else None,
        mixup=mixup,
    )

    # Train, evaluate, describe
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=last_checkpoint)
        end_if_stopped(trainer)
        trainer.save_model()
        record_metrics(trainer, "train", result.metrics)
        trainer.save_state()
    if eval_sets:
        evaluate_splits(trainer, eval_sets)
        if ema is not None:
            ema.swap_into(trainer.model)
            evaluate_splits(trainer, eval_sets, prefix="ema_")
            if training_args.do_train:
                trainer.save_model(os.path.join(training_args.output_dir, "ema"))
            ema.swap_into(trainer.model)
    publish(trainer, model_card_fields(model_args, data_args), training_args.push_to_hub)


if __name__ == "__main__":
    main()
