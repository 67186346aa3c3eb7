"""run_clm.py end to end on tiny generated text and a slice of the embedded Penn Treebank, the sliding-window
evaluation against direct per-token scoring, resuming, and the clear errors for bad input (two-process DDP:
tests/robustness/test_distributed.py)."""

import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch
import yaml
from tiny import BLOCK, FAST, ROOT, TINY_MODEL, WORDS, lm, tensorboard_scalars, write_lines
from torch.nn import functional as F
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
    default_data_collator,
    pipeline,
)

import modeling_plat  # noqa: F401
from plat_train import causal_lm as run_clm
from plat_train.arguments import PlatTrainingArguments, accelerator_available, parse_args
from plat_train.model_setup import build_config, parse_config_overrides
from plat_train.runs import HubUnreachableError
from plat_train.text_data import (
    document_pieces,
    iter_texts,
    load_penn_treebank,
    load_raw_splits,
    pack_split,
    token_stream,
    tokenize_splits,
    train_tokenizer,
    unigram_perplexity,
)
from plat_train.text_metrics import sliding_window_metrics, window_plan
from plat_train.trainers import PlatTrainer

SCRIPT = ROOT / "run_clm.py"

@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    return {split: write_lines(folder / f"{split}.txt", lines, seed)
            for split, lines, seed in (("train", 300, 0), ("validation", 40, 1), ("test", 40, 2))}


def files_args(text_files):
    return ["--train_file", str(text_files["train"]), "--validation_file", str(text_files["validation"]),
            "--test_file", str(text_files["test"])]


def results(output_dir):
    return json.loads((Path(output_dir) / "all_results.json").read_text())


def test_text_files_train_eval_save_and_reload(text_files, tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, *files_args(text_files), *FAST, "--tokenizer_type", "word", "--do_train",
                  "--do_eval", "--max_steps", "4", "--learning_rate", "3e-3", "--max_eval_samples", "8",
                  "--eval_stride", str(BLOCK), "--output_dir", str(output_dir)])
    metrics = results(output_dir)
    for prefix in ("eval", "test"):
        assert metrics[f"{prefix}_perplexity"] == pytest.approx(math.exp(metrics[f"{prefix}_loss"]))
        assert 0 <= metrics[f"{prefix}_accuracy"] <= 1
        assert metrics[f"{prefix}_samples"] == 8
        # Windows of the block size, moved by the block size, score exactly what evaluation on blocks scores.
        assert metrics[f"{prefix}_sliding_perplexity"] == pytest.approx(metrics[f"{prefix}_perplexity"], rel=1e-4)
        assert metrics[f"{prefix}_sliding_tokens"] == 8 * (BLOCK - 1)
        assert metrics[f"{prefix}_unigram_perplexity"] < len(WORDS) + 3
    assert metrics["train_loss"] > 0

    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert model.config.vocab_size == len(WORDS) + 3  # every training word, <unk>, <eos> and <pad>
    generator = pipeline("text-generation", model=str(output_dir))
    text = generator("the cat", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("the cat")

    # Evaluating the saved model alone (its tokenizer comes with it) gives the same figures.
    run_clm.main(["--model_name_or_path", str(output_dir), *files_args(text_files), *FAST, "--do_eval",
                  "--max_eval_samples", "8", "--output_dir", str(tmp_path / "eval")])
    assert results(tmp_path / "eval")["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)


def test_arguments_from_one_yaml_file(text_files, tmp_path):
    arguments = {
        "model_type": "plat", "config_overrides": TINY_MODEL[-1], "train_file": str(text_files["train"]),
        "tokenizer_type": "word", "do_train": True, "max_steps": 1, "per_device_train_batch_size": 4,
        "report_to": "none", "dataloader_pin_memory": False, "output_dir": str(tmp_path / "out"),
    }
    args_file = tmp_path / "args.yaml"
    args_file.write_text(yaml.safe_dump(arguments))
    run_clm.main([str(args_file)])
    assert trainer_step(tmp_path / "out") == 1


@pytest.mark.parametrize("accelerator", [False, True])
def test_data_loaders_pin_memory_only_where_an_accelerator_is(monkeypatch, tmp_path, accelerator):
    """Pinned memory serves copies to an accelerator; without one torch ignores it and warns at every data loader."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator)
    args = parse_args(HfArgumentParser(PlatTrainingArguments), ["--output_dir", str(tmp_path)])[0]
    assert args.dataloader_pin_memory is accelerator
    explicit = ["--output_dir", str(tmp_path), "--dataloader_pin_memory", "false"]
    assert parse_args(HfArgumentParser(PlatTrainingArguments), explicit)[0].dataloader_pin_memory is False


@pytest.mark.parametrize("cuda", [False, True])
def test_without_torch_accelerator_cuda_is_the_accelerator(monkeypatch, cuda):
    """torch before 2.6 has no ``torch.accelerator``; its data loaders pin memory for CUDA."""
    monkeypatch.delattr(torch, "accelerator")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert accelerator_available() is cuda


BAD_ARGUMENTS = {
    "a mistyped flag": (["plat-ptb-tiny.yaml", "--max_stepz", "3"],
                        "unrecognized arguments: --max_stepz 3 (did you mean: --max_stepz -> --max_steps?)"),
    "a recipe name that is not shipped": (["plat-ptb-tin.yaml"],
                                          "The arguments file 'plat-ptb-tin.yaml' is neither a path nor a shipped"),
    "a recipe file that is missing": (["{tmp}/missing.json"], "Arguments file not found: {tmp}/missing.json"),
    "a recipe file that is not YAML": (["{tmp}/broken.yaml"], "{tmp}/broken.yaml cannot be read: while parsing"),
    "a recipe file that is a list": (["{tmp}/list.yaml"], "{tmp}/list.yaml must hold a mapping of argument names"),
    "a model preset that is not shipped": (["--config_name", "plat-ptb-tine"],
                                           "--config_name 'plat-ptb-tine' is neither a path nor a shipped model"),
    "an override that is not key=value": (["--model_type", "plat", "--config_overrides", "hidden_size:32"],
                                          "--config_overrides entries must look like key=value; got 'hidden_size:32'"),
    "a stride below 1": (["--model_type", "plat", "--eval_stride", "0"], "--eval_stride must be at least 1; got 0"),
    "no windows per batch": (["--model_type", "plat", "--sliding_window_batch_size", "0"],
                             "--sliding_window_batch_size must be at least 1; got 0"),
    "no training blocks": (["--model_type", "plat", "--max_train_samples", "0"],
                           "--max_train_samples must be at least 1; got 0"),
    "a negative count of blocks to score": (["--model_type", "plat", "--max_eval_samples", "-3"],
                                            "--max_eval_samples must be at least 1; got -3"),
    "a held-out share above the whole": (["--model_type", "plat", "--validation_split_percentage", "150"],
                                         "--validation_split_percentage must lie between 0 (nothing held out) and 99; "
                                         "got 150"),
    "a negative held-out share": (["--model_type", "plat", "--validation_split_percentage", "-5"],
                                  "--validation_split_percentage must lie between 0 (nothing held out) and 99"),
    "a negative count of held-out streamed texts": (["--model_type", "plat", "--streaming_validation_texts", "-1"],
                                                    "--streaming_validation_texts must be at least 0; got -1"),
    "a word vocabulary of special tokens alone": (["--model_type", "plat", "--tokenizer_vocab_size", "3"],
                                                  "--tokenizer_vocab_size must be at least 4 (its special tokens and a "
                                                  "word); got 3"),
    "a BPE vocabulary smaller than the bytes": (["--model_type", "plat", "--tokenizer_type", "bpe",
                                                 "--tokenizer_vocab_size", "0"],
                                                "--tokenizer_vocab_size must be at least 259 for a bpe tokenizer (its "
                                                "256 bytes and special tokens); got 0"),
    "no examples per batch": (["--model_type", "plat", "--per_device_train_batch_size", "0"],
                              "--per_device_train_batch_size must be at least 1; got 0"),
    "no evaluation examples per batch": (["--model_type", "plat", "--per_device_eval_batch_size", "-2"],
                                         "--per_device_eval_batch_size must be at least 1; got -2"),
    "no batches per step": (["--model_type", "plat", "--gradient_accumulation_steps", "0"],
                            "--gradient_accumulation_steps must be at least 1; got 0"),
    "a negative count of loader processes": (["--model_type", "plat", "--dataloader_num_workers", "-1"],
                                             "--dataloader_num_workers must be at least 0; got -1"),
    "no training steps": (["--model_type", "plat", "--max_steps", "0"],
                          "--max_steps must be at least 1, or negative to train --num_train_epochs; got 0"),
    "no epochs to train": (["--model_type", "plat", "--num_train_epochs", "0"],
                           "--num_train_epochs must be above 0 unless --max_steps is given; got 0"),
    "a seed that numpy refuses": (["--model_type", "plat", "--seed", "-1"],
                                  "--seed must lie between 0 and 2**32 - 1; got -1"),
    "values that TrainingArguments refuses": (
        ["--model_type", "plat", "--eval_strategy", "steps", "--save_strategy", "epoch", "--load_best_model_at_end"],
        "--load_best_model_at_end requires the save and eval strategy to match"),
}  # fmt: skip


@pytest.mark.parametrize("arguments, message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS)
def test_bad_arguments_end_the_job_as_argparse_does(arguments, message, tmp_path, capsys):
    """Exit status 2 and one error on stderr, as argparse gives for a value of the wrong type, before anything runs."""
    (tmp_path / "broken.yaml").write_text("max_steps: [1\n")
    (tmp_path / "list.yaml").write_text("- max_steps\n")
    with pytest.raises(SystemExit) as stop:
        run_clm.main([argument.format(tmp=tmp_path) for argument in arguments] + ["--output_dir", f"{tmp_path}/out"])
    assert stop.value.code == 2
    assert "error: " + message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_json_file_with_other_column_and_bpe_tokenizer(tmp_path):
    lines = write_lines(tmp_path / "lines.txt", 200).read_text().splitlines()
    rows = [{"id": i, "body": line} for i, line in enumerate(lines)]
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, "--train_file", str(train_file), *FAST, "--tokenizer_type", "bpe",
                  "--tokenizer_vocab_size", "300", "--do_train", "--do_eval", "--max_steps", "2",
                  "--output_dir", str(output_dir)])
    metrics = results(output_dir)
    assert "eval_perplexity" in metrics and "test_perplexity" not in metrics  # validation held out of train
    assert AutoModelForCausalLM.from_pretrained(output_dir).config.vocab_size <= 300


def test_streaming_text_files(text_files, tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, *files_args(text_files), *FAST, "--tokenizer_type", "word", "--streaming",
                  "--do_train", "--do_eval", "--max_steps", "2", "--max_eval_samples", "4", "--eval_stride", "8",
                  "--output_dir", str(output_dir)])
    metrics = results(output_dir)
    assert trainer_step(output_dir) == 2
    assert metrics["eval_sliding_tokens"] == 4 * BLOCK - 1 and math.isfinite(metrics["test_perplexity"])
    assert "eval_unigram_perplexity" not in metrics


def test_arguments_file_then_flags_that_override_it(text_files, tmp_path):
    arguments = {"model_type": "plat", "config_overrides": TINY_MODEL[-1], "train_file": str(text_files["train"]),
                 "tokenizer_type": "word", "do_train": True, "max_steps": 3, "per_device_train_batch_size": 4,
                 "report_to": ["none"], "output_dir": str(tmp_path / "ignored")}
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps(arguments))
    run_clm.main([str(args_file), "--max_steps", "1", "--output_dir", str(tmp_path / "out")])
    assert trainer_step(tmp_path / "out") == 1 and not (tmp_path / "ignored").exists()


def test_streaming_eval_holds_out_the_start_of_the_stream(text_files, tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, "--train_file", str(text_files["train"]), *FAST, "--tokenizer_type", "word",
                  "--streaming", "--streaming_validation_texts", "40", "--do_train", "--do_eval", "--max_steps", "2",
                  "--output_dir", str(output_dir)])
    metrics = results(output_dir)
    assert math.isfinite(metrics["eval_perplexity"]) and "test_perplexity" not in metrics


@pytest.mark.parametrize("held_out", [300, 1000])  # the training file's 300 lines, and the default
def test_a_stream_no_longer_than_its_held_out_start_is_refused_by_name(text_files, held_out):
    with pytest.raises(ValueError, match=f"ends within its first {held_out} texts.*--streaming_validation_texts"):
        load_raw_splits(train_file=str(text_files["train"]), streaming=True, streaming_validation_texts=held_out)
    splits = load_raw_splits(train_file=str(text_files["train"]), streaming=True, streaming_validation_texts=299)
    assert [example["text"] for example in splits["train"]] == text_files["train"].read_text().splitlines()[299:]


def test_do_predict_scores_the_test_split_only(text_files, tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, *files_args(text_files), *FAST, "--tokenizer_type", "word", "--do_predict",
                  "--output_dir", str(output_dir)])
    metrics = results(output_dir)
    assert math.isfinite(metrics["test_perplexity"]) and 0 <= metrics["test_accuracy"] <= 1
    assert not any(name.startswith("eval_") for name in metrics)
    with pytest.raises(ValueError, match="--do_predict needs a test split"):
        run_clm.main([*TINY_MODEL, "--train_file", str(text_files["train"]), *FAST, "--do_predict",
                      "--output_dir", str(tmp_path / "no-test")])


@pytest.fixture(scope="module")
def gpt2_folder(text_files, tmp_path_factory):
    """A transformers GPT-2 checkpoint with a word tokenizer of the test texts."""
    folder = tmp_path_factory.mktemp("gpt2")
    tokenizer = train_tokenizer(text_files["train"].read_text().splitlines(), "word", model_max_length=BLOCK)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=BLOCK, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_folder(text_files, tmp_path_factory):
    """A transformers Llama checkpoint (one key/value head for two query heads) with a word tokenizer."""
    folder = tmp_path_factory.mktemp("llama")
    tokenizer = train_tokenizer(text_files["train"].read_text().splitlines(), "word", model_max_length=BLOCK)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=BLOCK, hidden_size=16,
                         intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("source", ["gpt2", "llama"])
def test_stock_model_is_converted_on_load_exactly(source, request, text_files, tmp_path):
    folder = request.getfixturevalue(f"{source}_folder")
    output_dir = tmp_path / "out"
    # A learning rate of 0 keeps the converted weights: with p = 2 the result is the source model itself.
    run_clm.main(["--model_name_or_path", str(folder), "--config_overrides", "plap_p=2.0",
                  *files_args(text_files), *FAST, "--do_train", "--max_steps", "1", "--learning_rate", "0",
                  "--output_dir", str(output_dir)])
    converted = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    assert type(converted).__name__ == "PlatForCausalLM" and converted.config.plap_p == 2.0
    ids = torch.randint(0, converted.config.vocab_size, (2, BLOCK))
    expected = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    torch.testing.assert_close(converted(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_stock_gpt2_fine_tunes_with_the_p_mix_and_reloads(gpt2_folder, text_files, tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main(["--model_name_or_path", str(gpt2_folder), "--config_overrides", "plap_p=[1.5,2.5]",
                  *files_args(text_files), *FAST, "--do_train", "--do_eval", "--max_steps", "3",
                  "--learning_rate", "1e-3", "--output_dir", str(output_dir)])
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert model.config.model_type == "plat" and model.config.plap_p == [1.5, 2.5]
    assert AutoTokenizer.from_pretrained(output_dir).get_vocab() == AutoTokenizer.from_pretrained(gpt2_folder).get_vocab()
    assert math.isfinite(results(output_dir)["eval_perplexity"])


def test_metrics_reach_tensorboard_and_disable_tqdm_silences_every_progress_bar(gpt2_folder, text_files, tmp_path):
    """In a process of its own, as a user runs it: the writer of the final evaluation flushes when the job ends, and no
    progress bar is printed, that of the stock checkpoint's loading included."""
    output_dir = tmp_path / "out"
    args = ["--model_name_or_path", str(gpt2_folder), *files_args(text_files), *FAST, "--do_train", "--do_eval",
            "--max_steps", "2", "--eval_stride", "8", "--max_eval_samples", "4", "--output_dir", str(output_dir),
            "--disable_tqdm", "true"]  # fmt: skip
    args[args.index("--report_to") + 1] = "tensorboard"
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "it/s]" not in output and "s/it]" not in output and "%|" not in output, output[-2000:]
    scalars, metrics = tensorboard_scalars(output_dir / "runs"), results(output_dir)
    for split in ("eval", "test"):
        for name in ("perplexity", "sliding_perplexity", "unigram_perplexity", "accuracy"):
            assert scalars[f"{split}/{name}"][-1] == pytest.approx(metrics[f"{split}_{name}"], rel=1e-6), (split, name)


def test_every_evaluation_reports_the_perplexity_and_the_best_checkpoint_can_be_chosen_by_it(text_files, tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, *files_args(text_files), *FAST, "--tokenizer_type", "word", "--do_train",
                  "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "1", "--save_steps", "1",
                  "--learning_rate", "3e-3", "--load_best_model_at_end", "--metric_for_best_model", "perplexity",
                  "--greater_is_better", "false", "--output_dir", str(output_dir)])  # fmt: skip
    state = json.loads((output_dir / "trainer_state.json").read_text())
    evaluations = [entry for entry in state["log_history"] if "eval_loss" in entry]
    assert len(evaluations) == 3
    for entry in evaluations:
        assert entry["eval_perplexity"] == pytest.approx(math.exp(entry["eval_loss"]), rel=1e-12)
    best = min(evaluations, key=lambda entry: entry["eval_perplexity"])
    assert state["best_metric"] == best["eval_perplexity"]
    assert state["best_model_checkpoint"].endswith(f"checkpoint-{best['step']}")


def test_penn_treebank_default_on_a_slice(tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, *FAST, "--do_train", "--do_eval", "--max_train_samples", "16", "--max_steps", "2",
                  "--max_eval_samples", "8", "--output_dir", str(output_dir)])
    metrics = results(output_dir)
    assert metrics["train_samples"] == 16 and metrics["eval_samples"] == metrics["test_samples"] == 8
    assert metrics["eval_unigram_perplexity"] > 1 and metrics["test_unigram_perplexity"] > 1
    assert AutoModelForCausalLM.from_pretrained(output_dir).config.vocab_size == 10001  # PTB's 10,000 and <pad>


def test_penn_treebank_streams_and_unigram_floor_match_the_published_figures():
    raw = load_penn_treebank()
    tokenizer = train_tokenizer(iter_texts(raw["train"]))
    tokenized = tokenize_splits(raw, tokenizer)
    streams = {split: token_stream(dataset) for split, dataset in tokenized.items()}
    assert {split: len(stream) for split, stream in streams.items()} == {
        "train": 929589, "validation": 73760, "test": 82430}  # words plus one <eos> per sentence
    assert len(tokenizer) == 10001  # PTB's 10,000 types (with <unk> and <eos>) and <pad>
    assert unigram_perplexity(streams["train"], streams["validation"], len(tokenizer)) == pytest.approx(685, abs=1)
    assert unigram_perplexity(streams["train"], streams["test"], len(tokenizer)) == pytest.approx(640, abs=1)


def trainer_step(output_dir):
    return json.loads((Path(output_dir) / "trainer_state.json").read_text())["global_step"]


def test_resume_continues_from_the_last_checkpoint(text_files, tmp_path, caplog):
    output_dir = tmp_path / "out"
    common = [*TINY_MODEL, *files_args(text_files), *FAST, "--tokenizer_type", "word", "--do_train",
              "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(output_dir)]
    run_clm.main([*common, "--max_steps", "2"])
    assert trainer_step(output_dir) == 2 and (output_dir / "checkpoint-2").is_dir()
    with caplog.at_level("INFO"):
        run_clm.main([*common, "--max_steps", "4"])  # finds checkpoint-2 in output_dir by itself
    assert "Checkpoint detected, resuming training at" in caplog.text
    assert trainer_step(output_dir) == 4
    run_clm.main([*common, "--max_steps", "6", "--resume_from_checkpoint", str(output_dir / "checkpoint-4")])
    assert trainer_step(output_dir) == 6

    shutil.rmtree(output_dir / "checkpoint-2"), shutil.rmtree(output_dir / "checkpoint-4")
    shutil.rmtree(output_dir / "checkpoint-6")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        run_clm.main([*common, "--max_steps", "2"])
    run_clm.main([*common, "--max_steps", "2", "--overwrite_output_dir"])
    assert trainer_step(output_dir) == 2


def test_the_same_command_runs_again_after_a_kill_before_the_first_finished_checkpoint(text_files, tmp_path, caplog):
    output_dir = tmp_path / "out"
    (output_dir / "checkpoint-2").mkdir(parents=True)  # killed while writing Trainer's state, which it writes last
    (output_dir / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2, "log_')
    (output_dir / "checkpoint-2" / "model.safetensors").write_bytes(b"\0" * 8)
    run_clm.main([*TINY_MODEL, *files_args(text_files), *FAST, "--tokenizer_type", "word", "--do_train",
                  "--save_steps", "2", "--max_steps", "2", "--output_dir", str(output_dir)])
    assert "training from the start" in caplog.text
    assert trainer_step(output_dir) == 2 and trainer_step(output_dir / "checkpoint-2") == 2


def direct_sliding_nll(model, stream, context_length):
    """Per-token scoring without windows: token t from the (up to context_length - 1) tokens before it,
    except that tokens inside the first window see only what precedes them there."""
    nll, correct = [], []
    for t in range(1, len(stream)):
        start = max(0, t - context_length + 1)
        with torch.no_grad():
            logits = model(input_ids=stream[None, start:t]).logits[0, -1]
        nll.append(F.cross_entropy(logits[None], stream[t : t + 1]))
        correct.append(bool(logits.argmax() == stream[t]))
    return torch.stack(nll).mean().item(), sum(correct) / len(correct)


@pytest.mark.parametrize("batch_size", [1, 5])
def test_stride_one_is_direct_per_token_scoring(batch_size):
    model = lm()
    stream = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    metrics = sliding_window_metrics(model, stream, context_length=8, stride=1, batch_size=batch_size)
    loss, accuracy = direct_sliding_nll(model, stream, 8)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(accuracy)
    assert metrics["tokens"] == 36


def test_stride_of_one_block_equals_loss_on_blocks():
    model = lm()
    blocks = torch.randint(0, model.config.vocab_size, (6, 10), generator=torch.Generator().manual_seed(1))
    metrics = sliding_window_metrics(model, blocks.flatten(), context_length=10, stride=10, batch_size=4)
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss.item()
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("num_tokens,length,stride", [(37, 8, 1), (37, 8, 3), (40, 8, 8), (41, 8, 8), (5, 8, 2)])
def test_window_plan_scores_every_token_once_with_the_window_before_it(num_tokens, length, stride):
    scored = []
    for begin, end, first in window_plan(num_tokens, length, stride):
        assert end - begin == min(length, num_tokens) and begin < first <= end
        scored.extend(range(first, end))
    # Windows as long as the stride skip their first token, like blocks; otherwise every token counts.
    skipped = {k * length for k in range(1, num_tokens // length)} if stride == length else set()
    assert scored == sorted(set(range(1, num_tokens)) - skipped)


def test_config_overrides_parse_lists_and_reject_unknown_fields():
    parsed = parse_config_overrides("hidden_size=64,plap_p=[1.5, 2.5],hidden_act=relu,qkv_bias=false")
    assert parsed == {"hidden_size": 64, "plap_p": [1.5, 2.5], "hidden_act": "relu", "qkv_bias": False}
    model_args = run_clm.TextModelArguments(model_type="plat", config_overrides="num_attention_heads=4,hidden_size=64")
    config = build_config(model_args, "text-generation")
    assert config.plap_p == [1.5, 1.5, 2.5, 2.5] and config.intermediate_size == 256
    with pytest.raises(ValueError, match="does not have"):
        build_config(run_clm.TextModelArguments(model_type="plat", config_overrides="n_embd=10"), "text-generation")
    with pytest.raises(ValueError, match="plap_p"):
        build_config(run_clm.TextModelArguments(config_name="plat-ptb-tiny", config_overrides="plap_p=[1.5]"),
                     "text-generation")
    for config_name in ("plat-ptb-tiny", None):  # transformers' name, set on a preset and on a fresh config
        model_args = run_clm.TextModelArguments(config_name=config_name, model_type="plat",
                                                config_overrides="attention_bias=false")
        config = build_config(model_args, "text-generation")
        assert (config.qkv_bias, config.o_proj_bias) == (False, False)


def test_a_model_must_be_chosen(text_files, tmp_path):
    with pytest.raises(ValueError, match="Choose a model"):
        run_clm.main(["--train_file", str(text_files["train"]), "--do_train", "--output_dir", str(tmp_path / "out")])


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        run_clm.main([*TINY_MODEL, "--train_file", str(tmp_path / "nowhere.txt"), "--do_train",
                      "--output_dir", str(tmp_path / "out")])


def test_empty_training_data_is_reported(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        run_clm.main([*TINY_MODEL, "--train_file", str(empty), "--validation_split_percentage", "0",
                      "--do_train", "--output_dir", str(tmp_path / "out")])


def test_text_shorter_than_one_block_is_reported(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("the cat sat on the mat\n")
    with pytest.raises(ValueError, match="fewer than one block"):
        run_clm.main([*TINY_MODEL, "--train_file", str(short), "--tokenizer_type", "word",
                      "--validation_split_percentage", "0", "--do_train", "--output_dir", str(tmp_path / "out")])


def test_block_size_beyond_the_context_is_reported(text_files, tmp_path):
    with pytest.raises(ValueError, match="larger than the model's max_position_embeddings"):
        run_clm.main([*TINY_MODEL, *files_args(text_files), "--block_size", str(BLOCK + 1), "--do_train",
                      "--output_dir", str(tmp_path / "out")])


def test_a_stride_beyond_the_block_is_refused_before_training(text_files, tmp_path):
    with pytest.raises(ValueError, match=f"--eval_stride {BLOCK + 1} is larger than the block size {BLOCK}"):
        run_clm.main([*TINY_MODEL, *files_args(text_files), "--eval_stride", str(BLOCK + 1), "--do_train", "--do_eval",
                      "--output_dir", str(tmp_path / "out")])  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_hub_dataset_while_offline_says_how_to_use_local_files(monkeypatch, tmp_path):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnreachableError, match="--train_file"):
        run_clm.main([*TINY_MODEL, "--dataset_name", "wikitext", "--dataset_config_name", "wikitext-103-v1",
                      "--do_train", "--output_dir", str(tmp_path / "out")])


def test_word_tokenizer_keeps_ids_contiguous_with_a_literal_unk():
    tokenizer = train_tokenizer(["a b <unk> c", "b <unk> a"], "auto")
    assert sorted(tokenizer.get_vocab().values()) == list(range(len(tokenizer)))
    assert tokenizer("<unk> zzz")["input_ids"] == [tokenizer.unk_token_id] * 2


@pytest.mark.parametrize("vocab_size", [258, 259])
def test_a_bpe_vocabulary_that_auto_chose_holds_every_byte(vocab_size):
    """--tokenizer_type auto resolves to BPE on text without <unk>, after the arguments were read: a vocabulary
    smaller than the bytes and special tokens is refused then, not trained at another size."""
    texts = ["the cat sat on the mat", "a dog ran under a tree"]
    if vocab_size < 259:
        with pytest.raises(ValueError, match="at least 259 for a bpe tokenizer"):
            train_tokenizer(texts, "auto", vocab_size)
    else:
        assert len(train_tokenizer(texts, "auto", vocab_size)) == vocab_size


@pytest.mark.parametrize("flags, warned", [({}, False), ({"tokenizer_vocab_size": 500}, True),
                                           ({"tokenizer_type": "bpe"}, True)])  # fmt: skip
def test_a_named_tokenizer_says_that_the_training_flags_do_not_shape_it(flags, warned, tmp_path, caplog):
    train_tokenizer(["a b <unk> c", "b <unk> a"], "word").save_pretrained(tmp_path / "tokenizer")
    model_args = run_clm.TextModelArguments(tokenizer_name=str(tmp_path / "tokenizer"), **flags)
    with caplog.at_level("WARNING"):
        tokenizer = run_clm.build_tokenizer(model_args, {}, None)
    assert len(tokenizer) == 6
    assert ("shape only a tokenizer trained here" in caplog.text) == warned


def test_saved_word_tokenizer_generates_readable_text_pads_and_starts_without_a_prompt(text_files, tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, "--train_file", str(text_files["train"]), *FAST, "--tokenizer_type", "word",
                  "--do_train", "--max_steps", "2", "--output_dir", str(output_dir)])
    generator = pipeline("text-generation", model=str(output_dir))

    # The README's example: the continuation is decoded apart from the prompt and must keep its spaces.
    text = generator("the cat sat", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert text.startswith("the cat sat ") and set(text.split()) <= set(WORDS), text
    assert "  " not in text

    # Batched generation pads with the tokenizer's pad token, the one the config names.
    tokenizer, config = generator.tokenizer, generator.model.config
    assert tokenizer.pad_token_id == config.pad_token_id != tokenizer.eos_token_id
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config.bos_token_id, config.eos_token_id)
    prompts = ["the cat", "a big red dog ran under"]
    batched = generator(prompts, max_new_tokens=4, do_sample=False, batch_size=2)
    alone = [generator(prompt, max_new_tokens=4, do_sample=False) for prompt in prompts]
    assert batched == alone

    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    batch = collator([tokenizer(prompt) for prompt in prompts])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 6)
    assert (batch["labels"] == -100).sum() == 4  # the padding of the shorter prompt only

    # Without a prompt, generation starts from the BOS token.
    generated = generator.model.generate(max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 4) and generated[0, 0] == tokenizer.bos_token_id


@pytest.mark.slow  # compiling takes about a minute on 2 CPU cores
def test_torch_compile_trains_and_saves_plain_weights(text_files, tmp_path):
    output_dir = tmp_path / "out"
    run_clm.main([*TINY_MODEL, *files_args(text_files), *FAST, "--tokenizer_type", "word", "--do_train",
                  "--max_steps", "2", "--torch_compile", "--output_dir", str(output_dir)])
    model, info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_llama_twin_recipes_run_by_name_and_differ_from_the_main_job_only_in_shape(tmp_path):
    """plat-llama-tiny / softmax-llama-tiny: the main job's size and budget; the twins differ only in p (their
    learning rates: test_configuration.py). The plat recipe runs by name, shortened by flags after it."""
    recipes = {name: yaml.safe_load((ROOT / "configuration" / "recipes" / f"{name}.yaml").read_text())
               for name in ("plat-ptb-tiny", "plat-llama-tiny", "softmax-llama-tiny")}
    same = lambda recipe: {k: v for k, v in recipe.items() if k not in ("config_name", "output_dir", "learning_rate")}
    assert same(recipes["plat-llama-tiny"]) == same(recipes["softmax-llama-tiny"]) == same(recipes["plat-ptb-tiny"])
    plat, softmax = (json.loads((ROOT / "configuration" / "models" / f"{name}.json").read_text())
                     for name in ("plat-llama-tiny", "softmax-llama-tiny"))
    assert {k: v for k, v in plat.items() if k != "plap_p"} == {k: v for k, v in softmax.items() if k != "plap_p"}

    output_dir = tmp_path / "out"
    run_clm.main(["plat-llama-tiny.yaml", "--max_steps", "2", "--max_train_samples", "8", "--max_eval_samples", "2",
                  "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "2", "--eval_stride", "128",
                  "--save_strategy", "no", "--output_dir", str(output_dir), "--disable_tqdm", "true"])
    config = AutoModelForCausalLM.from_pretrained(output_dir).config
    assert config.position_embedding_type == "rope" and config.head_shape() == (4, 16)
    assert math.isfinite(results(output_dir)["eval_perplexity"])


def test_padding_free_trains_on_whole_texts_and_evaluates_on_blocks(text_files, tmp_path):
    output_dir = tmp_path / "out"
    args = [*TINY_MODEL, *files_args(text_files), *FAST, "--tokenizer_type", "word", "--do_train", "--do_eval",
            "--max_steps", "2", "--max_eval_samples", "8", "--padding_free", "--output_dir", str(output_dir)]
    run_clm.main(args)
    metrics = results(output_dir)
    assert metrics["train_samples"] == 300  # every line (4-12 words and <eos>) is one text within a block
    assert metrics["eval_samples"] == 8 and math.isfinite(metrics["eval_loss"])

    # What the Trainer feeds: training batches are the texts packed into one row, positions restarting at each
    # text and its first token no target; evaluation batches stay blocks.
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    texts = [line.split() for line in text_files["train"].read_text().splitlines()[:4]]
    pieces = document_pieces(tokenize_splits(load_raw_splits(train_file=str(text_files["train"])), tokenizer)["train"],
                             BLOCK)  # fmt: skip
    training_args = TrainingArguments(tmp_path / "inspect", per_device_train_batch_size=4, per_device_eval_batch_size=4,
                                      report_to="none", dataloader_pin_memory=False,
                                      train_sampling_strategy="sequential")  # fmt: skip
    trainer = PlatTrainer(model=AutoModelForCausalLM.from_pretrained(output_dir), args=training_args,
                          train_dataset=pieces, data_collator=default_data_collator,
                          train_data_collator=DataCollatorWithFlattening(separator_id=-100))  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    lengths = [len(words) + 1 for words in texts]  # and <eos>
    assert batch["input_ids"].shape == (1, sum(lengths))
    assert batch["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1])
    assert (batch["labels"][0, starts] == -100).all()
    blocks = next(iter(trainer.get_eval_dataloader(pack_split(tokenize_splits(
        load_raw_splits(train_file=str(text_files["validation"])), tokenizer)["train"], BLOCK))))
    assert blocks["input_ids"].shape == (4, BLOCK) and "position_ids" not in blocks
