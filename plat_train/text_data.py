"""Language-modelling data: raw text splits, the tokenizer, tokenisation, and packing into fixed-length blocks.

Every split becomes a dataset with one ``text`` column; every text (a line of a .txt file, a row of a dataset)
ends with the tokenizer's end-of-sequence token, the standard treatment of line ends for PTB and WikiText.
Tokenised splits are concatenated into one token stream and cut into ``block_size`` blocks across text
boundaries, so that no token is dropped except the final partial block.
"""

import itertools
import logging
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .runs import explain_offline_errors

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
FILE_LOADERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}
UNK_TOKEN = "<unk>"
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (UNK_TOKEN, EOS_TOKEN, PAD_TOKEN)
DEFAULT_BPE_VOCAB_SIZE = 8192
# Byte-level BPE starts from every byte: a smaller vocabulary is not one it can keep.
BYTE_ALPHABET = 256
# How much of the training text to look at when guessing whether it is pre-tokenised (PTB / WikiText style).
TOKENIZER_SNIFF_LINES = 10_000


def load_penn_treebank():
    """The embedded default corpus: word-level Penn Treebank (Mikolov et al.) from the ``treebank`` package.

    One sentence per line, already tokenised, 10k words with ``<unk>``; no network needed.
    """
    import treebank

    # The package's strings end with an empty line; PTB itself has none.
    def lines(split):
        return [line for line in treebank.penn[split].splitlines() if line.strip()]

    return datasets.DatasetDict(
        {split: datasets.Dataset.from_dict({"text": lines(name)})
         for split, name in zip(SPLITS, ("train", "valid", "test"))}
    )


def _loader_for_files(data_files):
    loaders = {FILE_LOADERS.get(Path(path).suffix.lower()) for path in data_files.values()}
    if None in loaders or len(loaders) != 1:
        raise ValueError(
            f"Data files must all be .txt, .json/.jsonl or .csv files of the same kind; got {list(data_files.values())}"
        )
    return loaders.pop()


def load_raw_splits(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                    test_file=None, validation_split_percentage=5, streaming=False, cache_dir=None, token=None,
                    streaming_validation_texts=1000):
    """Train / validation / test text splits, each with a single ``text`` column.

    Sources, first match wins: a Hub dataset (``dataset_name``), local files (.txt: one text per line;
    .json/.jsonl/.csv: the ``text`` column, or the first string column), or the embedded Penn Treebank. A missing
    validation split is carved from the *end* of the training split (``validation_split_percentage``; transformers'
    run_clm.py takes the first percent instead), or, when streaming, from the first ``streaming_validation_texts``
    texts of the stream, which training then skips.
    """
    if dataset_name is not None:
        with explain_offline_errors(f"dataset {dataset_name!r}", "--train_file / --validation_file / --test_file"):
            raw = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir, streaming=streaming,
                                        token=token)
    elif train_file is not None or validation_file is not None or test_file is not None:
        data_files = {split: path for split, path in zip(SPLITS, (train_file, validation_file, test_file)) if path}
        for path in data_files.values():
            if not Path(path).is_file():
                raise FileNotFoundError(f"Data file not found: {path}")
        loader = _loader_for_files(data_files)
        raw = datasets.load_dataset(loader, data_files=data_files, cache_dir=cache_dir, streaming=streaming)
    else:
        logger.info("No dataset given: using the embedded Penn Treebank (word level, 10k vocabulary)")
        raw = load_penn_treebank()
        if streaming:
            raw = datasets.IterableDatasetDict({split: ds.to_iterable_dataset() for split, ds in raw.items()})
    raw = {_canonical_split(name): ds for name, ds in raw.items()}
    if "validation" not in raw and "train" in raw and streaming and streaming_validation_texts:
        logger.info(f"No validation split: holding out the first {streaming_validation_texts} streamed training texts")
        raw["validation"] = raw["train"].take(streaming_validation_texts)
        raw["train"] = raw["train"].skip(streaming_validation_texts)
        if next(iter(raw["train"]), None) is None:
            raise ValueError(
                f"The training stream ends within its first {streaming_validation_texts} texts, which "
                "--streaming_validation_texts holds out for validation: nothing is left to train on. Lower it, or "
                "give a validation split (--validation_file)."
            )
    elif "validation" not in raw and "train" in raw and not streaming and validation_split_percentage:
        logger.info(f"No validation split: holding out the last {validation_split_percentage}% of the training texts")
        train = raw["train"]
        num_validation = max(1, len(train) * validation_split_percentage // 100)
        raw["validation"] = train.select(range(len(train) - num_validation, len(train)))
        raw["train"] = train.select(range(len(train) - num_validation))
    splits = {split: _text_column_only(ds, split) for split, ds in raw.items() if split in SPLITS}
    for split, dataset in splits.items():
        if not any(text and text.strip() for text in iter_texts(dataset)):
            raise ValueError(f"The {split} data is empty: it has no text")
    return splits


def _canonical_split(name):
    return {"valid": "validation", "dev": "validation"}.get(name, name)


def _text_column_only(dataset, split):
    """The ``text`` column, else the first string column (the first column if the types are unknown)."""
    # A streamed dataset may only know its columns once read.
    columns = dataset.column_names or list(next(iter(dataset), {}))
    if not columns:
        raise ValueError(f"The {split} data has no columns: is the file empty?")
    features = dataset.features or {}
    strings = [name for name in columns if getattr(features.get(name), "dtype", None) in ("string", "large_string")]
    column = "text" if "text" in columns else (strings or columns)[0]
    if column != "text":
        logger.info(f"No 'text' column in the {split} data: using its column {column!r}")
        dataset = dataset.rename_column(column, "text")
    return dataset.select_columns(["text"])


def iter_texts(dataset, batch_size=1000):
    """The ``text`` values of a split, one string at a time, without loading the column into memory."""
    if isinstance(dataset, datasets.IterableDataset):
        return (example["text"] for example in dataset)
    return (text for batch in dataset.iter(batch_size=batch_size) for text in batch["text"])


def looks_pretokenised(texts):
    """PTB / WikiText style: words already split by spaces, out-of-vocabulary words replaced by ``<unk>``."""
    return any(UNK_TOKEN in text.split() for text in texts)


def word_vocabulary(texts, special_tokens, vocab_size=None):
    """Token -> id: the special tokens first, then the words by decreasing count (ties alphabetically).

    Built here rather than with tokenizers' WordLevelTrainer, which gives a word that is also a special
    token (PTB's literal ``<unk>``) a second id and leaves a hole in the id range.
    """
    counts = Counter()
    for text in texts:
        counts.update(text.split())
    for token in special_tokens:
        counts.pop(token, None)
    words = sorted(counts, key=lambda word: (-counts[word], word))
    if vocab_size is not None:
        words = words[: max(vocab_size - len(special_tokens), 0)]
    return {token: index for index, token in enumerate(special_tokens + words)}


def check_vocab_size(vocab_size, tokenizer_type):
    """Refuse a ``--tokenizer_vocab_size`` that the tokenizer cannot have: a word tokenizer needs a word beside its
    special tokens, byte-level BPE every byte and them (with fewer it would silently train that many); ``auto``, not
    yet resolved, needs what a word tokenizer does."""
    if vocab_size is None:
        return
    needs, smallest = "its special tokens and a word", len(SPECIAL_TOKENS) + 1
    if tokenizer_type == "bpe":
        needs, smallest = f"its {BYTE_ALPHABET} bytes and special tokens", len(SPECIAL_TOKENS) + BYTE_ALPHABET
    if vocab_size < smallest:
        kind = "" if tokenizer_type == "auto" else f" for a {tokenizer_type} tokenizer"
        raise ValueError(f"--tokenizer_vocab_size must be at least {smallest}{kind} ({needs}); got {vocab_size}")


def train_tokenizer(texts, tokenizer_type="auto", vocab_size=None, model_max_length=None):
    """A tokenizer trained on ``texts`` (an iterable of strings, usually the training split).

    ``word``: the vocabulary is every whitespace-separated word of the training text (the ``vocab_size``
    most frequent ones if given) plus ``<unk>``, ``<eos>`` and ``<pad>``; ``bpe``: byte-level BPE with
    ``vocab_size`` entries (default 8192) and the same special tokens; ``auto``: ``word`` for pre-tokenised text
    with ``<unk>`` markers, ``bpe`` otherwise. ``<eos>`` also begins a generation without a prompt (BOS), as every
    text follows the end of another; ``<pad>`` pads batches (pipelines, data collators).
    """
    texts, sniffed = itertools.tee(texts)
    if tokenizer_type == "auto":
        tokenizer_type = "word" if looks_pretokenised(itertools.islice(sniffed, TOKENIZER_SNIFF_LINES)) else "bpe"
        logger.info(f"Training a {tokenizer_type}-level tokenizer on the training split (--tokenizer_type auto)")
    check_vocab_size(vocab_size, tokenizer_type)
    special_tokens = list(SPECIAL_TOKENS)
    if tokenizer_type == "word":
        backend = Tokenizer(models.WordLevel(word_vocabulary(texts, special_tokens, vocab_size), unk_token=UNK_TOKEN))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        # Every token decodes with the space before it, as byte-level BPE tokens carry theirs: tokens decoded apart
        # from their prompt (pipeline("text-generation") does) stay apart from it. A whole text starts with one.
        backend.decoder = decoders.Replace(Regex("^"), " ")
    elif tokenizer_type == "bpe":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size,
            special_tokens=special_tokens,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        backend.train_from_iterator(texts, trainer=trainer)
    else:
        raise ValueError(f"tokenizer_type must be 'auto', 'word' or 'bpe'; got {tokenizer_type!r}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNK_TOKEN, eos_token=EOS_TOKEN,
                                        bos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    if model_max_length is not None:
        tokenizer.model_max_length = model_max_length
    logger.info(f"Trained a {tokenizer_type} tokenizer with {len(tokenizer)} tokens")
    return tokenizer


def tokenize_splits(raw_splits, tokenizer, num_proc=None, overwrite_cache=False):
    """Map each split's ``text`` to ``input_ids``, ending every text with the tokenizer's EOS token if it has one."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]

    def tokenize(batch):
        # verbose=False: texts longer than model_max_length are expected here; packing cuts them.
        ids = tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [line + eos for line in ids]}

    tokenized = {}
    for split, dataset in raw_splits.items():
        if isinstance(dataset, datasets.IterableDataset):
            tokenized[split] = dataset.map(tokenize, batched=True, remove_columns=["text"])
        else:
            tokenized[split] = dataset.map(
                tokenize, batched=True, remove_columns=["text"], num_proc=num_proc,
                load_from_cache_file=not overwrite_cache, desc=f"Running tokenizer on the {split} split",
            )
    return tokenized


def token_stream(tokenized, max_tokens=None):
    """All token ids of a tokenised split, concatenated in order, as a 1-D int64 tensor."""
    if isinstance(tokenized, datasets.IterableDataset):
        ids = []
        for example in tokenized:
            ids.extend(example["input_ids"])
            if max_tokens is not None and len(ids) >= max_tokens:
                break
        stream = torch.tensor(ids, dtype=torch.long)
    else:
        column = tokenized.with_format("arrow")[:]["input_ids"]
        stream = torch.from_numpy(pc.list_flatten(column).to_numpy().astype(np.int64))
    return stream if max_tokens is None else stream[:max_tokens]


class PackedBlocks(torch.utils.data.Dataset):
    """Consecutive, non-overlapping ``block_size`` slices of a token stream, as causal-LM examples."""

    def __init__(self, stream, block_size, max_blocks=None):
        num_blocks = len(stream) // block_size
        if max_blocks is not None:
            num_blocks = min(num_blocks, max_blocks)
        self.blocks = stream[: num_blocks * block_size].view(num_blocks, block_size)  # (num_blocks, block_size)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        block = self.blocks[index]
        # The model shifts labels inside, as every transformers causal LM does.
        return {"input_ids": block, "labels": block.clone()}


class StreamedBlocks(torch.utils.data.IterableDataset):
    """``PackedBlocks`` for a streamed split: blocks are cut on the fly, texts carried over block boundaries."""

    def __init__(self, tokenized, block_size, max_blocks=None):
        self.tokenized, self.block_size, self.max_blocks = tokenized, block_size, max_blocks

    def _blocks(self):
        buffer = []
        for example in self.tokenized:
            buffer.extend(example["input_ids"])
            while len(buffer) >= self.block_size:
                block, buffer = buffer[: self.block_size], buffer[self.block_size :]
                yield torch.tensor(block, dtype=torch.long)

    def __iter__(self):
        for block in itertools.islice(self._blocks(), self.max_blocks):
            yield {"input_ids": block, "labels": block.clone()}


def pack_split(tokenized, block_size, max_blocks=None, split="train"):
    """Blocks of ``block_size`` tokens for the Trainer; a clear error if the split cannot fill one."""
    if isinstance(tokenized, datasets.IterableDataset):
        return StreamedBlocks(tokenized, block_size, max_blocks)
    stream = token_stream(tokenized)
    blocks = PackedBlocks(stream, block_size, max_blocks)
    if len(blocks) == 0:
        raise ValueError(
            f"The {split} split has {len(stream)} tokens, fewer than one block of --block_size {block_size}: "
            "give more text or a smaller --block_size"
        )
    logger.info(f"{split}: {len(stream):,} tokens packed into {len(blocks):,} blocks of {block_size}")
    return blocks


def document_pieces(tokenized, block_size, max_pieces=None):
    """Every text as one training example (padding-free packing), texts longer than ``block_size`` cut into pieces
    of at most ``block_size`` tokens; the first ``max_pieces`` if given."""

    def cut(batch):
        return {"input_ids": [ids[start : start + block_size] for ids in batch["input_ids"]
                              for start in range(0, len(ids), block_size)]}  # fmt: skip

    pieces = tokenized.map(cut, batched=True)
    if max_pieces is not None:
        pieces = pieces.take(max_pieces) if isinstance(pieces, datasets.IterableDataset) else pieces.select(
            range(min(max_pieces, len(pieces))))  # fmt: skip
    return pieces


def unigram_perplexity(train_stream, eval_stream, vocab_size):
    """Perplexity of the add-one smoothed unigram model of ``train_stream`` on ``eval_stream``.

    The floor any language model should beat; word-level PTB gives about 685 (valid) and 640 (test).
    """
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    log_probs = counts.log() - counts.sum().log()
    return float(torch.exp(-log_probs[eval_stream].mean()))

