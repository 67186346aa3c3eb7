"""run_clm.py --attn_implementation plap: a transformers checkpoint (Qwen3 here) trains as itself with p-LaT attention,
and the saved model reloads as p-LaT, its config and card saying how."""

import json
import math

import pytest
import torch
from tiny import BLOCK, FAST, train_losses, write_lines
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import modeling_plat  # noqa: F401
from device import DEVICE
from plat_train import causal_lm as run_clm
from plat_train.text_data import train_tokenizer


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    return {split: write_lines(folder / f"{split}.txt", lines, seed)
            for split, lines, seed in (("train", 200, 0), ("validation", 30, 1), ("test", 30, 2))}


@pytest.fixture(scope="module")
def qwen3_folder(text_files, tmp_path_factory):
    """A transformers Qwen3 checkpoint (2 key/value heads for 4 query heads) with a word tokenizer."""
    folder = tmp_path_factory.mktemp("qwen3")
    tokenizer = train_tokenizer(text_files["train"].read_text().splitlines(), "word", model_max_length=BLOCK)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=BLOCK, hidden_size=16, head_dim=8,
                         intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(folder, text_files, output_dir, *flags):
    run_clm.main(["--model_name_or_path", str(folder), "--attn_implementation", "plap", "--train_file",
                  str(text_files["train"]), "--validation_file", str(text_files["validation"]), *FAST, "--do_train",
                  "--output_dir", str(output_dir), *flags])


def test_p2_trains_the_source_model_itself(qwen3_folder, text_files, tmp_path):
    # A learning rate of 0 keeps the weights: with p = 2 the saved model computes what the source computes.
    run(qwen3_folder, text_files, tmp_path, "--config_overrides", "plap_p=2.0", "--max_steps", "1",
        "--learning_rate", "0")
    assert json.loads((tmp_path / "config.json").read_text())["attn_implementation"] == "plap"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).to(DEVICE).eval()  # no argument: config.json says plap
    assert type(reloaded).__name__ == "Qwen3ForCausalLM" and reloaded.config._attn_implementation == "plap"
    source = AutoModelForCausalLM.from_pretrained(qwen3_folder, attn_implementation="eager").to(DEVICE).eval()
    ids = torch.randint(0, source.config.vocab_size, (2, BLOCK), device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-5)


def test_paper_mix_fine_tunes_and_reloads(qwen3_folder, text_files, tmp_path):
    run(qwen3_folder, text_files, tmp_path, "--config_overrides", "plap_p=[1.5,1.5,2.5,2.5],plap_formulation=euler",
        "--do_eval", "--max_steps", "3", "--learning_rate", "1e-3")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    assert reloaded.config._attn_implementation == "plap"
    assert (reloaded.config.plap_p, reloaded.config.plap_formulation) == ([1.5, 1.5, 2.5, 2.5], "euler")
    assert math.isfinite(json.loads((tmp_path / "all_results.json").read_text())["eval_perplexity"])
    card = (tmp_path / "README.md").read_text()
    assert 'attn_implementation="plap"' in card and "import modeling_plat" in card
    assert "AutoModelForCausalLM.from_pretrained(" in card
    # It keeps training after the reload, as p-LaT.
    ids = torch.randint(0, 20, (2, BLOCK), device=DEVICE)
    losses = train_losses(reloaded, 3, 1e-2, input_ids=ids, labels=ids)
    assert all(map(math.isfinite, losses))


def test_bad_p_is_refused_before_loading_weights(qwen3_folder, text_files, tmp_path):
    with pytest.raises(ValueError, match="one value per head"):
        run(qwen3_folder, text_files, tmp_path, "--config_overrides", "plap_p=[1.5,2.5]", "--max_steps", "1")
    with pytest.raises(ValueError, match="does not have"):
        run(qwen3_folder, text_files, tmp_path, "--config_overrides", "plap_q=2.0", "--max_steps", "1")
