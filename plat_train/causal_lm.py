"""The language-modelling job: train and evaluate p-LaT (or any causal) language models with Trainer; runs under
accelerate and torchrun. ``run_clm.py`` and the ``plat-run-clm`` command start it.

With no data arguments it trains on the embedded Penn Treebank with a word-level tokenizer trained on the
spot, and needs no network. Evaluation reports perplexity and token accuracy on the validation and test
splits (packed blocks), the add-one unigram perplexity as a floor, and, with --eval_stride, the paper's
sliding-window perplexity. All metrics land in <output_dir>/all_results.json and in the trackers of --report_to.

    python run_clm.py --config_name plat-ptb-tiny --do_train --do_eval --output_dir /tmp/plat-ptb
    python run_clm.py plat-ptb-tiny.yaml                  # a shipped recipe (or any .json / .yaml of arguments)
    python run_clm.py plat-ptb-tiny.yaml --config_name softmax-ptb-tiny --output_dir runs/softmax-ptb-tiny
    python run_clm.py --model_name_or_path gpt2 --do_train ...   # fine-tune GPT-2 converted to p-LaT (paper mix)

See docs/language_modeling.md for the paper-scale WikiText-103 commands.
"""

import logging
from dataclasses import dataclass, field
from typing import Literal

from transformers import (
    AutoTokenizer,
    DataCollatorWithFlattening,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

from .arguments import ModelArguments, PlatTrainingArguments, check_minimum, parse_args
from .model_cards import PTB_DATASET
from .model_setup import build_config, load_model, saved_config
from .preemption import end_if_stopped
from .runs import (
    check_launch,
    detect_last_checkpoint,
    evaluation_splits,
    explain_offline_errors,
    publish,
    record_metrics,
    setup_logging,
)
from .text_data import (
    check_vocab_size,
    document_pieces,
    iter_texts,
    load_raw_splits,
    pack_split,
    token_stream,
    tokenize_splits,
    train_tokenizer,
    unigram_perplexity,
)
from .text_metrics import preprocess_logits_for_metrics, sliding_window_metrics, token_accuracy
from .trainers import PlatTrainer

logger = logging.getLogger(__name__)


@dataclass
class TextModelArguments(ModelArguments):
    """The shared model arguments, plus a fresh model without a preset and the tokenizer."""

    model_type: Literal["plat"] | None = field(
        default=None, metadata={"help": "Train a fresh PlatConfig() model (with --config_overrides)."}
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

    def __post_init__(self):
        super().__post_init__()
        check_vocab_size(self.tokenizer_vocab_size, self.tokenizer_type)


@dataclass
class TextDataArguments:
    """What to train and evaluate on, and how to cut it into blocks and score it."""

    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset (needs the network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration name."})
    train_file: str | None = field(default=None, metadata={"help": "Training text (.txt, .json/.jsonl, .csv)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation text, same format."})
    test_file: str | None = field(default=None, metadata={"help": "Test text, same format."})
    validation_split_percentage: int = field(
        default=5,
        metadata={"help": "Share of the training texts held out (from the end) when there is no validation split."},
    )
    streaming_validation_texts: int = field(
        default=1000,
        metadata={"help": "With --streaming and no validation split: hold out this many texts from the stream's "
                          "start for validation (training skips them)."},
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per training block; default and maximum: the model's max_position_embeddings."},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use only this many training blocks (texts or pieces with --padding_free)."}
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Train on whole texts instead of blocks cut across them: each batch is its texts (cut at "
            "block_size) packed into one row without padding, and every text attends only within itself "
            "(transformers' DataCollatorWithFlattening)."
        },
    )
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

    def __post_init__(self):
        # Here, while the arguments are read, rather than after training (or, for a sample count, in a message about
        # the data); the stride's upper bound, the block size, is checked once the model's context is known
        # (check_stride).
        check_minimum(self, 1, "max_train_samples", "max_eval_samples", "eval_stride", "sliding_window_batch_size")
        check_minimum(self, 0, "streaming_validation_texts")
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError("--validation_split_percentage must lie between 0 (nothing held out) and 99; got "
                             f"{self.validation_split_percentage}")  # fmt: skip


def build_tokenizer(model_args, raw_splits, last_checkpoint, model_max_length=None):
    """A named tokenizer, the saved model's, the checkpoint's when resuming, or one trained on the training split."""
    named = model_args.tokenizer_name or model_args.model_name_or_path
    if named and (model_args.tokenizer_type != "auto" or model_args.tokenizer_vocab_size is not None):
        logger.warning(f"--tokenizer_type and --tokenizer_vocab_size shape only a tokenizer trained here: {named!r}'s "
                       "is used as it is")  # fmt: skip
    source = named or last_checkpoint
    if source is not None:
        with explain_offline_errors(f"tokenizer {source!r}", "--tokenizer_name with a local folder"):
            return AutoTokenizer.from_pretrained(source, **model_args.hub_kwargs())
    if "train" not in raw_splits:
        raise ValueError("No tokenizer to use: give --tokenizer_name or --model_name_or_path, or training data")
    return train_tokenizer(
        iter_texts(raw_splits["train"]), model_args.tokenizer_type, model_args.tokenizer_vocab_size, model_max_length
    )


def build_model(model_args, config, saved, tokenizer):
    """The saved model (``saved`` is its config; converted if a stock GPT-2 or Llama-family model; embeddings grown
    if the tokenizer is larger), or a new one sized to the tokenizer."""
    if model_args.model_name_or_path is None:
        config.vocab_size = len(tokenizer)
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if getattr(tokenizer, name) is not None:
                setattr(config, name, getattr(tokenizer, name))
        if getattr(config, "pad_token_id", None) is None and getattr(config, "eos_token_id", None) is not None:
            # Open-ended generation pads with EOS; saying so keeps generate() quiet.
            config.pad_token_id = config.eos_token_id
    with explain_offline_errors(f"model {model_args.model_name_or_path!r}", "a local model folder"):
        model = load_model(model_args, config, "text-generation", saved)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
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


def check_stride(stride, block_size):
    """``--eval_stride`` moves windows of ``block_size`` tokens: refused before training when it moves them further."""
    if stride is not None and stride > block_size:
        raise ValueError(f"--eval_stride {stride} is larger than the block size {block_size}: windows would skip "
                         "tokens")


def evaluate_split(trainer, prefix, blocks, tokenized, train_stream, data_args, block_size):
    """Metrics for one evaluation split: loss, perplexity and accuracy on blocks, unigram and sliding-window
    perplexities, all prefixed ``eval_`` (validation) or ``test_``."""
    metrics = trainer.evaluate(eval_dataset=blocks, metric_key_prefix=prefix)  # with the perplexity (PlatTrainer)
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
            disable_tqdm=trainer.args.disable_tqdm,
        )
        metrics.update({f"{prefix}_sliding_{name}": value for name, value in sliding.items()})
        metrics[f"{prefix}_sliding_stride"] = data_args.eval_stride
    if hasattr(blocks, "__len__"):
        metrics[f"{prefix}_samples"] = len(blocks)
    return metrics


def evaluate_splits(trainer, eval_blocks, eval_splits, tokenized, data_args, block_size):
    """Score every evaluation split (``eval_blocks`` by metric prefix) and record its metrics."""
    logger.info("*** Evaluate ***")
    # The unigram floor needs the whole training stream, which a streamed split does not give cheaply.
    train_stream = None if data_args.streaming or "train" not in tokenized else token_stream(tokenized["train"])
    for prefix, blocks in eval_blocks.items():
        metrics = evaluate_split(
            trainer, prefix, blocks, tokenized[eval_splits[prefix]], train_stream, data_args, block_size
        )
        record_metrics(trainer, prefix, metrics)


def model_card_fields(model_args, data_args):
    """What Trainer's model card should say about the starting point and the data."""
    card = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-generation"}
    if data_args.dataset_name is not None:
        card["dataset_tags"] = data_args.dataset_name
        card["dataset"] = " ".join(filter(None, (data_args.dataset_name, data_args.dataset_config_name)))
    elif not (data_args.train_file or data_args.validation_file or data_args.test_file):
        card["dataset"] = PTB_DATASET
    return card


def main(args=None):
    parser = HfArgumentParser((TextModelArguments, TextDataArguments, PlatTrainingArguments))
    model_args, data_args, training_args = parse_args(parser, args)
    check_launch(training_args)
    if model_args.model_type is None and not (model_args.config_name or model_args.model_name_or_path):
        raise ValueError("Choose a model: --config_name (a preset or path), --model_name_or_path or --model_type plat")
    setup_logging(training_args)
    last_checkpoint = detect_last_checkpoint(training_args)
    set_seed(training_args.seed)

    # Data
    raw_splits = load_raw_splits(
        data_args.dataset_name, data_args.dataset_config_name, data_args.train_file, data_args.validation_file,
        data_args.test_file, data_args.validation_split_percentage, data_args.streaming, model_args.cache_dir,
        model_args.token, data_args.streaming_validation_texts,
    )
    eval_splits = evaluation_splits(
        training_args, raw_splits, "give --train_file / --validation_file / --test_file, or a dataset with it"
    )

    # Model and tokenizer
    saved = saved_config(model_args)
    config = build_config(model_args, "text-generation", saved)
    block_size = resolve_block_size(data_args.block_size, config)
    check_stride(data_args.eval_stride, block_size)
    tokenizer = build_tokenizer(model_args, raw_splits, last_checkpoint, block_size)
    model = build_model(model_args, config, saved, tokenizer)

    # Datasets
    with training_args.main_process_first(desc="dataset tokenisation"):
        tokenized = tokenize_splits(
            raw_splits, tokenizer, data_args.preprocessing_num_workers, data_args.overwrite_cache
        )
    train_blocks = None
    if training_args.do_train and data_args.padding_free:
        train_blocks = document_pieces(tokenized["train"], block_size, data_args.max_train_samples)
    elif training_args.do_train:
        train_blocks = pack_split(tokenized["train"], block_size, data_args.max_train_samples, "train")
    eval_blocks = {prefix: pack_split(tokenized[split], block_size, data_args.max_eval_samples, split)
                   for prefix, split in eval_splits.items()}

    trainer = PlatTrainer(
        model=model,
        args=training_args,
        train_dataset=train_blocks,
        eval_dataset=eval_blocks.get("eval"),
        processing_class=tokenizer,
        data_collator=default_data_collator,
        # The first token of each text is no target of the text before it (separator_id = -100).
        train_data_collator=DataCollatorWithFlattening(separator_id=-100) if data_args.padding_free else None,
        compute_metrics=token_accuracy if eval_blocks else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if eval_blocks else None,
    )

    # Train, evaluate, describe
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=last_checkpoint)
        end_if_stopped(trainer)
        trainer.save_model()  # the tokenizer too
        metrics = result.metrics
        if hasattr(train_blocks, "__len__"):
            metrics["train_samples"] = len(train_blocks)
        record_metrics(trainer, "train", metrics)
        trainer.save_state()
    if eval_blocks:
        evaluate_splits(trainer, eval_blocks, eval_splits, tokenized, data_args, block_size)
    publish(trainer, model_card_fields(model_args, data_args), training_args.push_to_hub)


if __name__ == "__main__":
    main()
