"""Model cards: YAML metadata that parses, and a usage snippet that runs as printed through remote code."""

import re

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from modeling_plat import PlatConfig, PlatForCausalLM
from huggingface_hub import ModelCard

from plat_train.model_cards import PTB_DATASET, model_card, write_model_card
from tiny import LLAMA_SHAPE, TEXT_SHAPES, run_without_plugin, text_config


def save_tiny_lm(folder, **shape):
    words = ["<unk>", "<eos>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    config = PlatConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        plap_p=[1.5, 2.5], max_position_embeddings=64, eos_token_id=1, pad_token_id=1, **shape)
    PlatForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return config


def split_card(text):
    match = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert match, "the card must open with YAML front matter"
    return yaml.safe_load(match.group(1)), text[match.end():]


def test_card_metadata_model_index_and_body(tmp_path):
    config = PlatConfig(num_attention_heads=4, hidden_size=32, plap_p=[[1.5, 1.5, 2.5, 2.5]] * 4)
    metrics = {"eval_perplexity": 123.4567, "eval_runtime": 3.2, "test_perplexity": 120.5,
               "test_sliding_perplexity": 110.25, "test_accuracy": 0.25}
    card = model_card(config, "text-generation", "org/plat-ptb", metrics=metrics, dataset=PTB_DATASET,
                      command="python run_clm.py --x 1", base_model="gpt2", hyperparameters={"learning_rate": 3e-3})
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")  # parsed back as the Hub parses it
    metadata, body = split_card(loaded.content)
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
    assert {"p-laplacian-transformer", "plat"} <= set(metadata["tags"]) and metadata["license"] == "apache-2.0"
    assert metadata["datasets"] == [PTB_DATASET] and metadata["base_model"] == "gpt2"
    assert set(metadata["metrics"]) == {"perplexity", "accuracy"}
    results = {(r.dataset_split, r.metric_name): r.metric_value for r in loaded.data.eval_results}
    assert results == {("test", "Perplexity (sliding window)"): 110.25, ("test", "Perplexity"): 120.5,
                       ("test", "Token accuracy"): 0.25, ("validation", "Perplexity"): 123.4567}
    assert all(r.dataset_type == PTB_DATASET and r.task_type == "text-generation" for r in loaded.data.eval_results)
    assert loaded.data.model_name == "plat-ptb"
    assert "| test | Perplexity (sliding window) | 110.2 |" in body and "python run_clm.py --x 1" in body
    assert "runtime" not in body.lower().split("## training command")[0]
    assert "- learning_rate: 0.003" in body and "- transformers " in body
    assert "[1.5, 1.5, 2.5, 2.5]" in body and "trust_remote_code=True" in body


def test_card_without_a_hub_dataset_has_no_model_index(tmp_path):
    card = model_card(PlatConfig(), "text-generation", "local", metrics={"eval_perplexity": 99.0})
    assert card.data.eval_results is None and "| validation | Perplexity | 99 |" in card.content


def test_card_rejects_unknown_task():
    with pytest.raises(ValueError, match="task must be one of"):
        model_card(PlatConfig(), "translation", "x")


def test_architecture_line_names_the_decoder_shape():
    llama = model_card(text_config(**LLAMA_SHAPE), "text-generation", "x").content
    assert ("Llama-style decoder, GQA (4 query heads over 2 key/value heads): rotary positions (theta 500), "
            "pre-RMSNorm blocks, gated silu MLP." in llama)
    gpt2 = model_card(text_config(), "text-generation", "x").content
    assert "GPT-2-style decoder, multi-head attention: learned positions, pre-LayerNorm blocks, gelu MLP." in gpt2


@pytest.mark.parametrize("shape", sorted(TEXT_SHAPES))
def test_text_snippet_runs_as_printed_without_the_plugin(tmp_path, shape):
    folder = tmp_path / "plat-tiny"
    config = save_tiny_lm(folder, **TEXT_SHAPES[shape])
    card = write_model_card(folder, config, "text-generation", prompt="the cat")
    snippet = re.search(r"```python\n(.*?)```", card.read_text(), re.S).group(1)
    result = run_without_plugin(snippet, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("the cat")
