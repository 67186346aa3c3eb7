"""run_image_classification.py end to end on tiny generated image folders and a slice of Fashion-MNIST, plus
the augmentation pipeline and the clear errors for bad input."""

import gzip
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from tiny import tensorboard_scalars, two_processes
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageClassification,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
    ViTModel,
    pipeline,
)

import modeling_plat  # noqa: F401
from plat_train import image_classification as run_image_classification
from plat_train import vision_data
from plat_train.arguments import PlatTrainingArguments
from plat_train.ema import ModelEmaCallback, ema_decay
from plat_train.model_setup import parse_config_overrides
from plat_train.presets import image_processor_preset, resolve_config_name
from plat_train.trainers import ImageClassificationTrainer
from plat_train.vision_augment import RAND_AUGMENT_OPS, MixupCutmix, TrainTransform, random_erasing

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "run_image_classification.py"
FASHION_MNIST_PRESENT = Path(vision_data.FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz").is_file()

TINY_MODEL = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,plap_p=[1.5,2.5]"
TINY_RGB = f"{TINY_MODEL},image_size=16,patch_size=4,num_channels=3"
TINY_GRAY = f"{TINY_MODEL},image_size=28,patch_size=7,num_channels=1"
CLASSES = ("circle", "square", "stripes")


def draw(kind, size, rng):
    """A small RGB image whose class is visible: a bright disc, a bright square, or stripes, on noise."""
    height, width = size
    yy, xx = np.mgrid[:height, :width]
    noise = rng.integers(0, 60, (height, width, 3))
    if kind == "circle":
        mask = (yy - height / 2) ** 2 + (xx - width / 2) ** 2 < (min(size) / 3) ** 2
    elif kind == "square":
        mask = (abs(yy - height / 2) < height / 4) & (abs(xx - width / 2) < width / 4)
    else:
        mask = (xx // 3) % 2 == 0
    return Image.fromarray((noise + 180 * mask[..., None]).clip(0, 255).astype(np.uint8))


def make_folder(root, per_class=6, classes=CLASSES, seed=0):
    rng = np.random.default_rng(seed)
    for kind in classes:
        (root / kind).mkdir(parents=True)
        for i in range(per_class):
            size = (20, 20) if i % 2 else (18, 24)  # non-square images exercise the resize and crop
            draw(kind, size, rng).save(root / kind / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    return make_folder(root / "train"), make_folder(root / "validation", per_class=3, seed=1)


def run(args):
    run_image_classification.main([str(a) for a in args])


def folder_args(folders, output_dir, *extra):
    train_dir, validation_dir = folders
    return ["--train_dir", train_dir, "--validation_dir", validation_dir, "--output_dir", output_dir,
            "--config_name", "plat-deit-tiny", "--config_overrides", TINY_RGB, "--per_device_train_batch_size", 8,
            "--per_device_eval_batch_size", 16, "--report_to", "none", "--disable_tqdm", "true",
            "--dataloader_num_workers", 0, *extra]


def results(output_dir):
    return json.loads((Path(output_dir) / "all_results.json").read_text())


# ---- augmentations --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_train_transform_shapes_and_seeded_determinism(mode):
    image = draw("circle", (30, 22), np.random.default_rng(0)).convert(mode)
    channels = len(image.getbands())
    transform = TrainTransform(16, [0.5] * channels, [0.25] * channels, rand_augment_ops=2, erase_prob=0.5)

    def views(seed):
        random.seed(seed)
        torch.manual_seed(seed)
        return torch.stack([transform(image) for _ in range(8)])

    first = views(3)
    assert first.shape == (8, channels, 16, 16) and first.dtype == torch.float32
    assert torch.equal(first, views(3))
    assert not torch.equal(first, views(4))


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_every_rand_augment_op_keeps_size_and_mode(mode):
    image = draw("stripes", (20, 26), np.random.default_rng(0)).convert(mode)
    for name, op in RAND_AUGMENT_OPS.items():
        for level in (0.0, 1.0):
            out = op(image, level, random.Random(0))
            assert (out.size, out.mode) == (image.size, image.mode), name


def test_random_erasing_changes_one_rectangle_only():
    tensor = torch.zeros(3, 32, 32)
    erased = random_erasing(tensor, random.Random(0), torch.Generator().manual_seed(0), probability=1.0)
    changed = (erased != 0).any(0)
    rows, cols = changed.any(1).nonzero().flatten(), changed.any(0).nonzero().flatten()
    assert changed.sum() > 0 and changed.sum() == len(rows) * len(cols)
    assert torch.equal(tensor, torch.zeros(3, 32, 32))  # input untouched


@pytest.mark.parametrize("mixup_alpha,cutmix_alpha", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_mixup_cutmix_soft_targets(mixup_alpha, cutmix_alpha):
    mix = MixupCutmix(num_classes=5, mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha)
    pixels, labels = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 4, 0])
    mixed, targets = mix(pixels, labels, random.Random(7))
    again, targets_again = mix(pixels, labels, random.Random(7))
    assert mixed.shape == pixels.shape and targets.shape == (6, 5)
    assert torch.equal(mixed, again) and torch.equal(targets, targets_again)
    assert torch.allclose(targets.sum(1), torch.ones(6))
    # Image i is mixed with image 5 - i only: its weight sits on its own class and its mirror's.
    assert targets[0, 0] == pytest.approx(1.0)  # labels 0 and 0
    assert targets[1, 1] + targets[1, 4] == pytest.approx(1.0)  # labels 1 and 4


def test_config_overrides_accept_lists_and_strings():
    parsed = parse_config_overrides("plap_p=[1.5,2.5],hidden_act=relu,image_size=32,qkv_bias=false")
    assert parsed == {"plap_p": [1.5, 2.5], "hidden_act": "relu", "image_size": 32, "qkv_bias": False}
    with pytest.raises(ValueError, match="key=value"):
        parse_config_overrides("plap_p")


# ---- end to end -----------------------------------------------------------------------------------------


def test_image_folders_full_recipe_then_pipeline(folders, tmp_path):
    output_dir = tmp_path / "out"
    run(folder_args(
        folders, output_dir, "--do_train", "--do_eval", "--max_steps", 3, "--learning_rate", 1e-3,
        "--mixup_alpha", 0.8, "--cutmix_alpha", 1.0, "--label_smoothing_factor", 0.1, "--rand_augment_ops", 2,
        "--random_erase_prob", 0.25, "--eval_crop_pct", 0.875, "--model_ema", "--model_ema_decay", 0.9,
        "--weight_decay", 0.05, "--lr_scheduler_type", "cosine", "--warmup_steps", 1,
    ))
    metrics = results(output_dir)
    for key in ("eval_loss", "eval_top1_accuracy", "eval_top5_accuracy", "ema_eval_top1_accuracy", "train_loss"):
        assert key in metrics
    assert metrics["eval_top5_accuracy"] == 1.0  # 3 classes: the top 5 hold them all
    assert not [key for key in metrics if "perplexity" in key]  # the language-model trainer's metric alone
    # The text job's file names: eval_ for the validation split.
    assert (output_dir / "eval_results.json").is_file() and (output_dir / "ema_eval_results.json").is_file()
    classifier = pipeline("image-classification", model=str(output_dir))
    predictions = classifier(draw("square", (40, 30), np.random.default_rng(5)))
    assert {p["label"] for p in predictions} == set(CLASSES)
    assert pipeline("image-classification", model=str(output_dir / "ema"))(draw("circle", (20, 20), np.random.default_rng(0)))


def test_weight_decay_spares_biases_norms_cls_token_and_positions(folders, tmp_path):
    config = AutoConfig.from_pretrained(resolve_config_name("plat-deit-tiny"), num_hidden_layers=1)
    model = AutoModelForImageClassification.from_config(config)
    trainer = ImageClassificationTrainer(model=model, args=PlatTrainingArguments(output_dir=str(tmp_path), report_to="none"))
    decayed = set(trainer.get_decay_parameter_names(model))
    assert "vit.embeddings.patch_embeddings.weight" in decayed and "classifier.weight" in decayed
    for name, _ in model.named_parameters():
        if name.endswith("bias") or "norm" in name or "cls_token" in name or "position_embeddings" in name:
            assert name not in decayed, name


def test_resume_from_last_checkpoint(folders, tmp_path, caplog):
    output_dir = tmp_path / "out"
    common = ["--do_train", "--save_steps", 2, "--model_ema"]
    run(folder_args(folders, output_dir, *common, "--max_steps", 2))
    assert (output_dir / "checkpoint-2" / "model_ema.safetensors").is_file()
    with caplog.at_level(logging.INFO):
        run(folder_args(folders, output_dir, *common, "--max_steps", 4))
    assert "resuming training at" in caplog.text and "checkpoint-2" in caplog.text
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert not list(output_dir.rglob("*.tmp"))
    # Killed after Trainer's state but before the average (written last): that checkpoint is passed over.
    (output_dir / "checkpoint-4" / "model_ema.safetensors").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run(folder_args(folders, output_dir, *common, "--max_steps", 6))
    assert "checkpoint-4: it has no model_ema.safetensors" in caplog.text
    assert "resuming training at" in caplog.text and "checkpoint-2" in caplog.text
    assert json.loads((output_dir / "trainer_state.json").read_text())["global_step"] == 6


def test_unknown_override_is_refused(folders, tmp_path):
    with pytest.raises(ValueError, match="does not have.*hiden_size"):
        run(folder_args(folders, tmp_path / "out", "--do_train", "--config_overrides", "hiden_size=32"))


def test_do_predict_scores_the_test_split_only(tmp_path):
    if not FASHION_MNIST_PRESENT:
        pytest.skip(f"Fashion-MNIST absent: `{vision_data.FASHION_MNIST_INSTALL}`")
    output_dir = tmp_path / "out"
    run(["--output_dir", output_dir, "--do_predict", "--config_overrides", TINY_GRAY, "--max_eval_samples", 32,
         "--per_device_eval_batch_size", 32, "--report_to", "none", "--disable_tqdm", "true"])
    metrics = results(output_dir)
    assert 0 <= metrics["test_top1_accuracy"] <= 1 and not any(name.startswith("eval_") for name in metrics)
    assert "| test | Top-1 accuracy |" in (output_dir / "README.md").read_text()  # a card, though nothing trained


def test_metrics_reach_tensorboard(folders, tmp_path):
    output_dir = tmp_path / "out"
    args = [str(a) for a in folder_args(folders, output_dir, "--do_train", "--do_eval", "--max_steps", 2,
                                        "--model_ema", "--save_strategy", "no")]
    args[args.index("--report_to") + 1] = "tensorboard"
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    scalars, metrics = tensorboard_scalars(output_dir / "runs"), results(output_dir)
    for name in ("top1_accuracy", "top5_accuracy"):
        assert scalars[f"eval/{name}"][-1] == pytest.approx(metrics[f"eval_{name}"], rel=1e-6)
        assert scalars[f"train/ema_eval_{name}"][-1] == pytest.approx(metrics[f"ema_eval_{name}"], rel=1e-6)


@pytest.fixture(scope="module")
def vit_folders(tmp_path_factory):
    """transformers ViT checkpoints: a classifier of the three test classes, and a trunk alone."""
    root = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
                       patch_size=4, num_labels=3, id2label=dict(enumerate(CLASSES)),
                       label2id={name: i for i, name in enumerate(CLASSES)})
    processor = ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for name, model_class in (("classifier", ViTForImageClassification), ("trunk", ViTModel)):
        model_class(config).save_pretrained(root / name)
        processor.save_pretrained(root / name)
    return root / "classifier", root / "trunk"


def stock_args(folders, source, output_dir, overrides, *extra):
    train_dir, validation_dir = folders
    return ["--model_name_or_path", source, "--config_overrides", overrides, "--train_dir", train_dir,
            "--validation_dir", validation_dir, "--output_dir", output_dir, "--do_train", "--save_strategy", "no",
            "--per_device_train_batch_size", 8, "--report_to", "none", "--disable_tqdm", "true", *extra]


def test_stock_vit_is_converted_on_load_exactly(folders, vit_folders, tmp_path):
    source, _ = vit_folders
    output_dir = tmp_path / "out"
    # A learning rate of 0 keeps the converted weights: with p = 2 the result computes what the ViT does.
    run(stock_args(folders, source, output_dir, "plap_p=2.0", "--max_steps", 1, "--learning_rate", 0))
    converted = AutoModelForImageClassification.from_pretrained(output_dir).eval()
    assert type(converted).__name__ == "PlatForImageClassification" and converted.config.plap_p == 2.0
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    expected = ViTForImageClassification.from_pretrained(source).eval()(pixels).logits
    torch.testing.assert_close(converted(pixels).logits, expected, rtol=1e-5, atol=1e-5)
    assert list(AutoImageProcessor.from_pretrained(output_dir).image_mean) == [0.5] * 3  # the source's statistics kept


def test_stock_vit_trunk_fine_tunes_with_the_p_mix_and_a_new_classifier(folders, vit_folders, tmp_path):
    _, trunk = vit_folders
    output_dir = tmp_path / "out"
    run(stock_args(folders, trunk, output_dir, "plap_p=[1.5,2.5],plap_formulation=euler", "--do_eval",
                   "--max_steps", 2, "--learning_rate", 1e-3))
    model = AutoModelForImageClassification.from_pretrained(output_dir)
    assert model.config.model_type == "plat_vision" and model.config.plap_p == [1.5, 2.5]
    assert model.config.plap_formulation == "euler" and model.config.id2label == dict(enumerate(CLASSES))
    classifier = pipeline("image-classification", model=str(output_dir))
    assert {p["label"] for p in classifier(draw("circle", (20, 20), np.random.default_rng(0)))} == set(CLASSES)


def test_ema_decay_warms_up_and_forgets_the_initial_weights():
    assert ema_decay(1, 0.99996, warmup=False) == 0.99996
    assert ema_decay(1, 0.99996) == pytest.approx(1 - 2 ** -0.75)
    assert ema_decay(10 ** 9, 0.99996) == 0.99996
    # The share of the initial weights left after a 4-epoch Fashion-MNIST run (1,688 steps).
    kept = lambda warmup: float(np.prod([ema_decay(t, 0.99996, warmup) for t in range(1, 1689)]))
    assert kept(False) > 0.9 and kept(True) < 1e-6


def test_ema_callback_follows_the_weights_with_warmup():
    model = torch.nn.Linear(2, 1)
    callback = ModelEmaCallback(decay=0.9)
    state = SimpleNamespace(global_step=0)
    callback.on_train_begin(None, state, None, model=model)
    expected = model.weight.detach().clone()
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.fill_(float(step))
        state.global_step = step
        callback.on_step_end(None, state, None, model=model)
        decay = min(0.9, 1 - (1 + step) ** -0.75)
        expected = decay * expected + (1 - decay) * step
    callback.swap_into(model)
    torch.testing.assert_close(model.weight.detach(), expected)
    callback.swap_into(model)
    assert torch.equal(model.weight.detach(), torch.full_like(expected, 5.0))


@pytest.mark.skipif(not FASHION_MNIST_PRESENT, reason=f"Fashion-MNIST absent: `{vision_data.FASHION_MNIST_INSTALL}`")
def test_fashion_mnist_default_and_grayscale_pipeline(tmp_path):
    output_dir = tmp_path / "fmnist"
    run(["--output_dir", output_dir, "--do_train", "--do_eval", "--config_overrides", TINY_GRAY,
         "--max_train_samples", 64, "--max_eval_samples", 64, "--max_steps", 2, "--per_device_train_batch_size", 32,
         "--per_device_eval_batch_size", 64, "--report_to", "none", "--disable_tqdm", "true"])
    metrics = results(output_dir)
    for split in ("eval", "test"):
        assert 0 <= metrics[f"{split}_top1_accuracy"] <= metrics[f"{split}_top5_accuracy"] <= 1
    config = json.loads((output_dir / "config.json").read_text())
    assert config["num_channels"] == 1 and config["id2label"]["9"] == "Ankle boot"
    saved = AutoImageProcessor.from_pretrained(output_dir)  # the default preset's statistics, not a generic 0.5
    preset = image_processor_preset("plat-fmnist-tiny")
    assert [list(saved.image_mean), list(saved.image_std)] == [preset["image_mean"], preset["image_std"]]
    classifier = pipeline("image-classification", model=str(output_dir), trust_remote_code=True)
    gray = Image.fromarray(np.random.default_rng(0).integers(0, 255, (28, 28), dtype=np.uint8), "L")
    # The pipeline opens images as RGB; the saved processor folds them back to the model's one channel.
    assert classifier(gray) == classifier(gray.convert("RGB"))
    assert len(classifier(gray.resize((50, 40)))) == 5


@pytest.mark.skipif(not FASHION_MNIST_PRESENT, reason=f"Fashion-MNIST absent: `{vision_data.FASHION_MNIST_INSTALL}`")
def test_the_fashion_mnist_preset_normalises_with_the_training_images_statistics():
    pixels = vision_data.read_idx(vision_data.fashion_mnist_files()["train"][0]) / 255
    shipped = image_processor_preset("plat-fmnist-tiny")
    assert shipped["image_mean"] == [round(float(pixels.mean()), 3)]
    assert shipped["image_std"] == [round(float(pixels.std()), 3)]


def write_idx(path, array):
    """An idx gzip file: a magic number whose low byte is the number of dimensions, each size, the bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(size.to_bytes(4, "big") for size in array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_images_are_the_idx_pixels(tmp_path):
    rng = np.random.default_rng(0)
    pixels = {"train": rng.integers(0, 256, (3, 28, 28)), "test": rng.integers(0, 256, (2, 28, 28))}
    for split, (images_path, labels_path) in vision_data.fashion_mnist_files(tmp_path).items():
        write_idx(images_path, pixels[split])
        write_idx(labels_path, np.arange(len(pixels[split])))
    loaded = vision_data.load_fashion_mnist(tmp_path)
    for split, expected in pixels.items():
        images = loaded[split]["image"]
        assert all(image.mode == "L" for image in images)
        assert np.array_equal(np.stack([np.asarray(image) for image in images]), expected)
        assert loaded[split]["label"] == list(range(len(expected)))


def test_missing_fashion_mnist_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        run(["--output_dir", tmp_path / "out", "--do_train", "--fashion_mnist_dir", tmp_path / "nowhere"])


BAD_ARGUMENTS = {
    "a mistyped flag": (["--mixup_alpa", 0.8],
                        "unrecognized arguments: --mixup_alpa 0.8 (did you mean: --mixup_alpa -> --mixup_alpha?)"),
    "a probability above 1": (["--hflip_prob", 2], "--hflip_prob must lie between 0 and 1; got 2.0"),
    "an EMA decay above 1": (["--model_ema_decay", 1.5], "--model_ema_decay must lie between 0 and 1; got 1.5"),
    "an eval crop of nothing": (["--eval_crop_pct", 0], "--eval_crop_pct is a fraction of the image: above 0"),
    "a crop larger than the image": (["--crop_scale_min", 1.5], "--crop_scale_min is a fraction of the image"),
    "a negative alpha": (["--cutmix_alpha", -1], "--cutmix_alpha must be at least 0; got -1.0"),
    "no training images": (["--max_train_samples", 0], "--max_train_samples must be at least 1; got 0"),
    "no images per batch": (["--per_device_train_batch_size", 0],
                            "--per_device_train_batch_size must be at least 1; got 0"),
}  # fmt: skip


@pytest.mark.parametrize("arguments, message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS)
def test_bad_arguments_end_the_job_as_argparse_does(arguments, message, tmp_path, capsys):
    """The image job's own flags (augmentation's included) are among those an unknown one is matched with, and its
    ranges are checked as the arguments are read (test_run_clm.py: the other ways arguments go wrong)."""
    with pytest.raises(SystemExit) as stop:
        run(["plat-fmnist-tiny.yaml", *arguments, "--output_dir", tmp_path / "out"])
    assert stop.value.code == 2
    assert "error: " + message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo on Linux/macOS")
def test_two_process_ddp_on_cpu(folders, tmp_path):
    train_dir, validation_dir = folders
    output_dir = tmp_path / "ddp"
    command = [
        *two_processes("torchrun"), str(SCRIPT),
        *map(str, folder_args(folders, output_dir, "--do_train", "--do_eval", "--max_steps", 2,
                              "--use_cpu", "--ddp_backend", "gloo", "--mixup_alpha", 0.8)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    metrics = results(output_dir)
    assert "eval_top1_accuracy" in metrics
    assert json.loads((output_dir / "trainer_state.json").read_text())["global_step"] == 2


# ---- bad input ------------------------------------------------------------------------------------------


def test_empty_folder_is_refused(tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    with pytest.raises(ValueError, match="No images found"):
        vision_data.load_image_folders(tmp_path / "train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        vision_data.load_image_folders(tmp_path / "missing")


def test_unreadable_folder_is_refused(tmp_path):
    for kind in CLASSES[:2]:
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "0.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="None of the 2 image files"):
        vision_data.load_image_folders(tmp_path)


def test_single_class_is_refused(tmp_path):
    make_folder(tmp_path / "train", per_class=2, classes=("only",))
    with pytest.raises(ValueError, match="single class"):
        vision_data.load_image_folders(tmp_path / "train")


def test_corrupt_images_are_skipped_and_counted(tmp_path, caplog):
    train_dir = make_folder(tmp_path / "train", per_class=2)
    (train_dir / "circle" / "broken.png").write_bytes(b"\x89PNG truncated")
    png = (train_dir / "square" / "0.png").read_bytes()
    (train_dir / "square" / "cut.png").write_bytes(png[: len(png) // 2])
    with caplog.at_level(logging.WARNING):
        splits = vision_data.load_image_folders(train_dir)
    assert len(splits["train"]) == 6
    assert "Skipped 2 of 8 unreadable or corrupt image files" in caplog.text


def test_mismatched_num_labels_asks_for_ignore_mismatched_sizes(folders, tmp_path):
    saved = tmp_path / "saved"
    run(folder_args(folders, saved, "--do_train", "--max_steps", 1))
    two_classes = make_folder(tmp_path / "two", per_class=2, classes=CLASSES[:2])
    args = ["--train_dir", two_classes, "--train_val_split", 0.25, "--model_name_or_path", saved, "--do_train",
            "--max_steps", 1, "--per_device_train_batch_size", 2, "--report_to", "none", "--disable_tqdm", "true"]
    with pytest.raises(ValueError, match="--ignore_mismatched_sizes"):
        run([*args, "--output_dir", tmp_path / "a"])
    run([*args, "--output_dir", tmp_path / "b", "--ignore_mismatched_sizes"])
    assert len(json.loads((tmp_path / "b" / "config.json").read_text())["id2label"]) == 2
