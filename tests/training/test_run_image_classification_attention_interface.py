"""run_image_classification.py --attn_implementation plap: a transformers ViT or DeiT checkpoint trains as itself with
p-LaT attention on the default data (Fashion-MNIST), and the saved model reloads as p-LaT."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForImageClassification,
    DeiTConfig,
    DeiTForImageClassification,
    DeiTForImageClassificationWithTeacher,
    ViTConfig,
    ViTForImageClassification,
)

import modeling_plat  # noqa: F401
from device import DEVICE
from plat_train import image_classification as run_image_classification
from plat_train import vision_data

needs_fashion_mnist = pytest.mark.skipif(
    not Path(vision_data.FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz").is_file(),
    reason=f"Fashion-MNIST absent: `{vision_data.FASHION_MNIST_INSTALL}`",
)

# Fashion-MNIST's shape (28 x 28 grayscale, 10 classes) at tiny sizes: the source's classifier is kept.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28,
            patch_size=7, num_channels=1, num_labels=10)
SOURCES = {"vit": (ViTForImageClassification, ViTConfig), "deit": (DeiTForImageClassification, DeiTConfig),
           "distilled-deit": (DeiTForImageClassificationWithTeacher, DeiTConfig)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: folder} of transformers classifiers with seeded random weights."""
    root = tmp_path_factory.mktemp("sources")
    for name, (model_class, config_class) in SOURCES.items():
        torch.manual_seed(0)
        model_class(config_class(**TINY)).save_pretrained(root / name)
    return {name: root / name for name in SOURCES}


def run(source, output_dir, overrides, *flags):
    run_image_classification.main([
        "--model_name_or_path", str(source), "--attn_implementation", "plap", "--config_overrides", overrides,
        "--output_dir", str(output_dir), "--do_train", "--max_train_samples", "32", "--max_eval_samples", "32",
        "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32", "--save_strategy", "no",
        "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0", *flags,
    ])


def pixels():
    return torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0)).to(DEVICE)


@needs_fashion_mnist
def test_p2_trains_the_source_vit_itself(checkpoints, tmp_path):
    # A learning rate of 0 keeps the weights: with p = 2 the saved model computes what the source computes.
    run(checkpoints["vit"], tmp_path, "plap_p=2.0", "--max_steps", "1", "--learning_rate", "0")
    assert json.loads((tmp_path / "config.json").read_text())["attn_implementation"] == "plap"
    reloaded = AutoModelForImageClassification.from_pretrained(tmp_path).to(DEVICE).eval()  # config.json says plap
    assert type(reloaded).__name__ == "ViTForImageClassification" and reloaded.config._attn_implementation == "plap"
    source = AutoModelForImageClassification.from_pretrained(checkpoints["vit"], attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(pixels()).logits, source.to(DEVICE).eval()(pixels()).logits,
                                   rtol=1e-5, atol=1e-5)


@needs_fashion_mnist
def test_paper_mix_fine_tunes_deit_and_reloads(checkpoints, tmp_path):
    run(checkpoints["deit"], tmp_path, "plap_p=[1.5,2.5],plap_formulation=euler", "--do_eval", "--max_steps", "3",
        "--learning_rate", "1e-3")
    assert math.isfinite(json.loads((tmp_path / "all_results.json").read_text())["eval_loss"])
    reloaded = AutoModelForImageClassification.from_pretrained(tmp_path, attn_implementation="plap").to(DEVICE)
    assert type(reloaded).__name__ == "DeiTForImageClassification"
    assert (reloaded.config.plap_p, reloaded.config.plap_formulation) == ([1.5, 2.5], "euler")
    card = (tmp_path / "README.md").read_text()  # how to load it: the image classifier's Auto class
    assert "AutoModelForImageClassification.from_pretrained(" in card and 'attn_implementation="plap"' in card
    softmax = AutoModelForImageClassification.from_pretrained(tmp_path, attn_implementation="eager").to(DEVICE)
    with torch.no_grad():
        change = (reloaded.eval()(pixels()).logits - softmax.eval()(pixels()).logits).abs().max()
    assert change > 1e-3  # the reloaded model runs p-LaT, not softmax attention


def test_distilled_deit_is_refused_before_the_data_load(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="inference only.*DeiTForImageClassification"):
        # Data that do not exist: the refusal comes first.
        run(checkpoints["distilled-deit"], tmp_path, "plap_p=2.0", "--fashion_mnist_dir", str(tmp_path / "nowhere"))
