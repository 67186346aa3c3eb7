#!/usr/bin/env python
"""Train and evaluate p-LaT (or any causal) language models with Trainer; runs under accelerate and torchrun.

With no data arguments it trains on the embedded Penn Treebank with a word-level tokenizer trained on the
spot, and needs no network. Evaluation reports perplexity and token accuracy on the validation and test
splits (packed blocks), the add-one unigram perplexity as a floor, and, with --eval_stride, the paper's
sliding-window perplexity. All metrics land in <output_dir>/all_results.json.

    python run_clm.py --config_name plat-ptb-tiny --do_train --do_eval --output_dir /tmp/plat-ptb
    python run_clm.py args.json        # or args.yaml: the same arguments in one file

See docs/language_modeling.md for the paper-scale WikiText-103 commands.
"""

import logging
from dataclasses import dataclass, field
from typing import Literal

import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

import modeling_plat
from plat_train.common import (
    PlatTrainingArguments,
    detect_last_checkpoint,
    parse_args,
    record_metrics,
    resolve_config_name,
    setup_logging,
)
from plat_train.lm_data import (
    iter_texts,
    load_raw_splits,
    pack_split,
    token_stream,
    tokenize_splits,
    train_tokenizer,
    unigram_perplexity,
)
from plat_train.lm_eval import perplexity, preprocess_logits_for_metrics, sliding_window_metrics, token_accuracy
from plat_train.model_card import PlatTrainer

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model and tokenizer to train: a preset or config, a saved model, or a fresh PlatConfig."""

    config_name: str | None = field(
        default=None,
        metadata={"help": "A preset's short name (e.g. plat-ptb-tiny, see configuration/) or a config path."},
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A saved model (folder or Hub id) to continue training or to evaluate."}
    )
    model_type: Literal["plat"] | None = field(
        default=None, metadata={"help": "Train a fresh PlatConfig() model (with --config_overrides)."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated config fields to override, e.g. 'hidden_size=64,hidden_dropout_prob=0.2,"
            "plap_p=[1.5,2.5]'; values are read as YAML."
        },
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "A saved tokenizer (folder or Hub id); default: train one on the data."}
    )
    tokenizer_type: Literal["auto", "word", "bpe"] = field(
        default="auto",
        metadata={
            "help": "Tokenizer to train: word level (PTB / WikiText style, every training word), byte-level BPE, "
            "or auto (word if the training text marks unknown words with <unk>)."
        },
    )
    tokenizer_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Vocabulary of the trained tokenizer; default: every word (word), 8192 (bpe)."},
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache downloaded datasets and models."})


@dataclass
class DataArguments:
    """What to train and evaluate on, and how to cut it into blocks and score it."""

    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset (needs the network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration name."})
    train_file: str | None = field(default=None, metadata={"help": "Training text (.txt, .json/.jsonl, .csv)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation text, same format."})
    test_file: str | None = field(default=None, metadata={"help": "Test text, same format."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Share of the training texts held out when there is no validation split."}
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per training block; default and maximum: the model's max_position_embeddings."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only this many training blocks."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Use only this many blocks (their tokens, for sliding windows) per eval split."}
    )
    streaming: bool = field(
        default=False, metadata={"help": "Stream the data instead of loading it (needs max_steps)."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Re-tokenise even if a cached result exists."})
    eval_stride: int | None = field(
        default=None,
        metadata={
            "help": "Also compute the sliding-window perplexity, moving windows of block_size tokens by this "
            "many; 1 is the paper's protocol (every token scored with the full context), block_size equals "
            "the fast evaluation."
        },
    )
    sliding_window_batch_size: int = field(
        default=1, metadata={"help": "Windows per forward pass in sliding-window evaluation (the paper used 1)."}
    )


def parse_config_overrides(text):
    """'a=1,b=[1.5,2.5],c=gelu' -> {'a': 1, 'b': [1.5, 2.5], 'c': 'gelu'}; commas inside brackets are kept."""
    overrides, pieces, depth, start = {}, [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    for piece in filter(str.strip, pieces):
        key, sep, value = piece.partition("=")
        if not sep:
            raise ValueError(f"--config_overrides entries must look like key=value; got {piece!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def build_config(model_args):
    """The model config: a preset or path, a saved model's, or a fresh PlatConfig, with the overrides applied."""
    overrides = parse_config_overrides(model_args.config_overrides) if model_args.config_overrides else {}
    if model_args.config_name:
        config = AutoConfig.from_pretrained(resolve_config_name(model_args.config_name), cache_dir=model_args.cache_dir)
    elif model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, cache_dir=model_args.cache_dir)
    elif model_args.model_type == "plat":
        config = modeling_plat.PlatConfig()
    else:
        raise ValueError("Choose a model: --config_name (a preset or path), --model_name_or_path or --model_type plat")
    unknown = sorted(key for key in overrides if not hasattr(config, key))
    if unknown:
        raise ValueError(f"--config_overrides names fields that {type(config).__name__} does not have: {unknown}")
    if overrides:
        logger.info(f"Overriding config: {overrides}")
    if overrides and model_args.config_name is None and model_args.model_name_or_path is None:
        # A fresh config: defaults that depend on overridden fields (plap_p on the head count,
        # intermediate_size on hidden_size) follow them.
        config = modeling_plat.PlatConfig(**overrides)
    for key, value in overrides.items():
        setattr(config, key, value)
    if hasattr(config, "validate_plat"):
        config.validate_plat()
    return config


def build_tokenizer(model_args, raw_splits, last_checkpoint, model_max_length=None):
    """A named tokenizer, the saved model's, the checkpoint's when resuming, or one trained on the training split."""
    source = model_args.tokenizer_name or model_args.model_name_or_path or last_checkpoint
    if source is not None:
        return AutoTokenizer.from_pretrained(source, cache_dir=model_args.cache_dir)
    if "train" not in raw_splits:
        raise ValueError("No tokenizer to use: give --tokenizer_name or --model_name_or_path, or training data")
    return train_tokenizer(
        iter_texts(raw_splits["train"]), model_args.tokenizer_type, model_args.tokenizer_vocab_size, model_max_length
    )


def build_model(model_args, config, tokenizer):
    """The saved model (its embeddings grown if the tokenizer is larger), or a fresh one sized to the tokenizer."""
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, config=config, cache_dir=model_args.cache_dir
        )
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer))
        return model
    config.vocab_size = len(tokenizer)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(tokenizer, name) is not None:
            setattr(config, name, getattr(tokenizer, name))
    if getattr(config, "pad_token_id", None) is None and getattr(config, "eos_token_id", None) is not None:
        # Open-ended generation pads with EOS; saying so keeps generate() quiet.
        config.pad_token_id = config.eos_token_id
    model = AutoModelForCausalLM.from_config(config)
    size = sum(p.numel() for p in model.parameters())
    logger.info(f"Training a new {config.model_type} model from scratch: {size / 1e6:.2f}M parameters")
    return model


def resolve_block_size(block_size, config):
    """``--block_size``, defaulting to the model's context length, which it may not exceed."""
    context_length = getattr(config, "max_position_embeddings", None)
    if block_size is None:
        if context_length is None:
            raise ValueError("The model config has no max_position_embeddings: pass --block_size")
        return context_length
    if block_size < 2:
        raise ValueError(f"--block_size must be at least 2; got {block_size}")
    if context_length is not None and block_size > context_length:
        raise ValueError(
            f"--block_size {block_size} is larger than the model's max_position_embeddings ({context_length}): "
            f"use --block_size {context_length} or less, or a model with a longer context"
        )
    return block_size


def evaluate_split(trainer, prefix, blocks, tokenized, train_stream, data_args, block_size):
    """Metrics for one evaluation split: loss, perplexity and accuracy on blocks, unigram and sliding-window
    perplexities, all prefixed ``eval_`` (validation) or ``test_``."""
    metrics = trainer.evaluate(eval_dataset=blocks, metric_key_prefix=prefix)
    metrics[f"{prefix}_perplexity"] = perplexity(metrics[f"{prefix}_loss"])
    max_tokens = None if data_args.max_eval_samples is None else data_args.max_eval_samples * block_size
    needs_stream = train_stream is not None or data_args.eval_stride is not None
    stream = token_stream(tokenized, max_tokens) if needs_stream else None
    if train_stream is not None:
        vocab_size = trainer.model.config.vocab_size
        metrics[f"{prefix}_unigram_perplexity"] = unigram_perplexity(train_stream, stream, vocab_size)
    if data_args.eval_stride is not None:
        sliding = sliding_window_metrics(
            trainer.accelerator.unwrap_model(trainer.model),
            stream,
            context_length=block_size,
            stride=data_args.eval_stride,
            batch_size=data_args.sliding_window_batch_size,
            accelerator=trainer.accelerator,
            autocast=trainer.autocast_smart_context_manager,
            desc=f"Sliding-window {prefix} (stride {data_args.eval_stride})",
        )
        metrics.update({f"{prefix}_sliding_{name}": value for name, value in sliding.items()})
        metrics[f"{prefix}_sliding_stride"] = data_args.eval_stride
    if hasattr(blocks, "__len__"):
        metrics[f"{prefix}_samples"] = len(blocks)
    return metrics


def model_card_fields(model_args, data_args):
    """What Trainer's model card should say about the starting point and the data."""
    card = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-generation"}
    if data_args.dataset_name is not None:
        card["dataset_tags"] = data_args.dataset_name
        card["dataset"] = " ".join(filter(None, (data_args.dataset_name, data_args.dataset_config_name)))
    elif not (data_args.train_file or data_args.validation_file or data_args.test_file):
        card["dataset"] = "ptb_text_only"  # the Hub's id of the Penn Treebank word-level text
    return card


def main(args=None):
    parser = HfArgumentParser((ModelArguments, DataArguments, PlatTrainingArguments))
    model_args, data_args, training_args = parse_args(parser, args)
    setup_logging(training_args)
    logger.warning(
        f"Process rank: {training_args.process_index}, device: {training_args.device}, n_gpu: {training_args.n_gpu}, "
        f"distributed training: {training_args.parallel_mode.value == 'distributed'}, "
        f"16-bits training: {training_args.fp16 or training_args.bf16}"
    )
    logger.info(f"Training/evaluation parameters {training_args}")
    last_checkpoint = detect_last_checkpoint(training_args)
    set_seed(training_args.seed)

    raw_splits = load_raw_splits(
        data_args.dataset_name, data_args.dataset_config_name, data_args.train_file, data_args.validation_file,
        data_args.test_file, data_args.validation_split_percentage, data_args.streaming, model_args.cache_dir,
    )
    if training_args.do_train and "train" not in raw_splits:
        raise ValueError("--do_train needs a training split: give --train_file or a dataset with a 'train' split")
    if training_args.do_eval and "validation" not in raw_splits:
        raise ValueError("--do_eval needs a validation split: give --validation_file or a dataset with one")

    config = build_config(model_args)
    block_size = resolve_block_size(data_args.block_size, config)
    tokenizer = build_tokenizer(model_args, raw_splits, last_checkpoint, block_size)
    model = build_model(model_args, config, tokenizer)

    with training_args.main_process_first(desc="dataset tokenisation"):
        tokenized = tokenize_splits(
            raw_splits, tokenizer, data_args.preprocessing_num_workers, data_args.overwrite_cache
        )
    train_blocks = (
        pack_split(tokenized["train"], block_size, data_args.max_train_samples, "train")
        if training_args.do_train else None
    )
    eval_splits = {"eval": "validation", "test": "test"} if training_args.do_eval else {}
    eval_blocks = {
        prefix: pack_split(tokenized[split], block_size, data_args.max_eval_samples, split)
        for prefix, split in eval_splits.items() if split in tokenized
    }

    trainer = PlatTrainer(
        model=model,
        args=training_args,
        train_dataset=train_blocks,
        eval_dataset=eval_blocks.get("eval"),
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=token_accuracy if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
        trainer.save_model()  # the tokenizer too
        metrics = train_result.metrics
        if hasattr(train_blocks, "__len__"):
            metrics["train_samples"] = len(train_blocks)
        record_metrics(trainer, "train", metrics)
        trainer.save_state()

    if eval_blocks:
        logger.info("*** Evaluate ***")
        # The unigram floor needs the whole training stream, which a streamed split does not give cheaply.
        train_stream = None if data_args.streaming or "train" not in tokenized else token_stream(tokenized["train"])
        for prefix, blocks in eval_blocks.items():
            metrics = evaluate_split(
                trainer, prefix, blocks, tokenized[eval_splits[prefix]], train_stream, data_args, block_size
            )
            record_metrics(trainer, prefix, metrics)

    card = model_card_fields(model_args, data_args)
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    else:
        trainer.create_model_card(**card)


if __name__ == "__main__":
    main()
