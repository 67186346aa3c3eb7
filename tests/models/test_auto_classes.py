"""A user's path through transformers with saved vision checkpoints: the Auto classes, the image processor and
both image pipelines, with the plugin imported (on the tests' device, tests/device.py) and, in a fresh process, without
it (remote code, on the CPU); and each family with its own config type."""

import copy
import json
import textwrap

import numpy as np
import pytest
import torch
from device import DEVICE
from PIL import Image
from tiny import run_without_plugin, vision_config
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    ViTImageProcessorPil,
    pipeline,
)

from modeling_plat import (
    PlatConfig,
    PlatForCausalLM,
    PlatForImageClassification,
    PlatImageProcessor,
    PlatModel,
    PlatVisionConfig,
    PlatVisionModel,
)

LABELS = {0: "circle", 1: "square", 2: "stripes"}


def make_image(seed=0, size=20):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=[3, 1], ids=["rgb", "gray"])
def vision_folder(request, tmp_path_factory):
    """A saved classifier with its processor (transformers' own for RGB, ours for grayscale) and its model."""
    channels = request.param
    torch.manual_seed(0)
    config = vision_config(num_channels=channels, num_labels=3, id2label=LABELS,
                           label2id={v: k for k, v in LABELS.items()}, plap_p=[1.5, 2.5, 2.5])
    model = PlatForImageClassification(config).eval()
    folder = tmp_path_factory.mktemp(f"vision{channels}")
    model.save_pretrained(folder)
    kwargs = dict(size={"height": 16, "width": 16}, image_mean=[0.5] * channels, image_std=[0.25] * channels)
    processor = PlatImageProcessor(do_grayscale=True, **kwargs) if channels == 1 else ViTImageProcessorPil(**kwargs)
    processor.save_pretrained(folder)
    return folder, model, processor


def expected_outputs(model, processor, image, device=DEVICE):
    model = copy.deepcopy(model).to(device)  # the fixture's model stays on the CPU for the other tests
    pixels = processor(image.convert("RGB"), return_tensors="pt").pixel_values.to(device)
    with torch.no_grad():
        probabilities = model(pixels).logits.softmax(-1)[0]
        features = model.vit(pixels).last_hidden_state[0]
    return probabilities, features


def test_auto_classes_and_pipelines_with_the_plugin(vision_folder):
    folder, model, processor = vision_folder
    assert type(AutoConfig.from_pretrained(folder)) is PlatVisionConfig
    trunk = AutoModel.from_pretrained(folder)
    assert type(trunk) is PlatVisionModel
    for name, tensor in trunk.state_dict().items():
        assert torch.equal(tensor, model.vit.state_dict()[name]), name  # the trained weights, not a fresh init
    assert type(AutoModelForImageClassification.from_pretrained(folder)) is PlatForImageClassification
    assert type(AutoImageProcessor.from_pretrained(folder)) is type(processor)

    image = make_image()
    probabilities, features = expected_outputs(model, processor, image)
    # device: a pipeline otherwise takes the first GPU where there is one, whatever the tests' device.
    predictions = pipeline("image-classification", model=str(folder), device=DEVICE)(image)
    by_label = {p["label"]: p["score"] for p in predictions}
    for index, label in LABELS.items():
        assert by_label[label] == pytest.approx(probabilities[index].item(), abs=1e-5)
    extracted = pipeline("image-feature-extraction", model=str(folder), device=DEVICE)(image)
    extracted = torch.tensor(extracted, device=DEVICE)[0]
    torch.testing.assert_close(extracted, features, rtol=1e-4, atol=1e-5)


def test_pipelines_do_not_ask_to_trust_remote_code_with_the_plugin(vision_folder, monkeypatch):
    """Pipelines probe for a video processor; the grayscale processor's auto_map would make them ask whether to run
    the checkpoint's remote code for one, unless the plugin says there is none (the register call's form differs
    between transformers versions)."""
    folder, _, _ = vision_folder
    asked = []
    monkeypatch.setattr("builtins.input", lambda question="": asked.append(question) or "n")
    for task in ("image-classification", "image-feature-extraction"):
        pipeline(task, model=str(folder), device="cpu")(make_image())
    assert asked == []


# On the CPU (a pipeline takes the first GPU unless told otherwise): the point is loading through remote code on a
# machine with transformers alone, and the fresh process's outputs are compared with ones computed on a known device.
WITHOUT_PLUGIN = textwrap.dedent(
    """
    import json
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoModel, AutoModelForImageClassification, pipeline
    folder = sys.argv[1]
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 20, 3), dtype=np.uint8))
    kwargs = {"trust_remote_code": True}
    report = {
        "config": type(AutoConfig.from_pretrained(folder, **kwargs)).__name__,
        "trunk": type(AutoModel.from_pretrained(folder, **kwargs)).__name__,
        "head": type(AutoModelForImageClassification.from_pretrained(folder, **kwargs)).__name__,
        "processor": type(AutoImageProcessor.from_pretrained(folder, **kwargs)).__name__,
        "classified": pipeline("image-classification", model=folder, device="cpu", **kwargs)(image),
        "features": pipeline("image-feature-extraction", model=folder, device="cpu", **kwargs)(image),
    }
    print(json.dumps(report))
    """
)


def test_auto_classes_and_pipelines_without_the_plugin(vision_folder, tmp_path):
    folder, model, processor = vision_folder
    result = run_without_plugin(WITHOUT_PLUGIN, tmp_path, folder)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["config"], report["trunk"], report["head"]) == (
        "PlatVisionConfig", "PlatVisionModel", "PlatForImageClassification")
    assert report["processor"] == type(processor).__name__
    # On the CPU, as the fresh process computes: where the patch convolution runs on a GPU, cuDNN may round its
    # inputs to TF32 (torch.backends.cudnn.allow_tf32 is on by default), far above these tolerances.
    probabilities, features = expected_outputs(model, processor, make_image(), device="cpu")
    by_label = {p["label"]: p["score"] for p in report["classified"]}
    for index, label in LABELS.items():
        assert by_label[label] == pytest.approx(probabilities[index].item(), abs=1e-5)
    torch.testing.assert_close(torch.tensor(report["features"])[0], features, rtol=1e-4, atol=1e-5)


def test_text_folder_still_gives_the_text_trunk(tmp_path):
    torch.manual_seed(0)
    PlatForCausalLM(PlatConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)).save_pretrained(tmp_path)
    assert type(AutoModel.from_pretrained(tmp_path)) is PlatModel
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is PlatForCausalLM


def test_each_family_has_its_own_config_type():
    assert type(AutoConfig.for_model("plat")) is PlatConfig
    assert type(AutoConfig.for_model("plat_vision")) is PlatVisionConfig
    assert not hasattr(PlatConfig(), "image_size") and not hasattr(PlatVisionConfig(), "vocab_size")
    for config in (PlatConfig(plap_p=[1.5] * 4 + [2.5] * 4), PlatVisionConfig(num_channels=1, plap_p=2.0)):
        assert type(config).from_dict(json.loads(config.to_json_string())).to_dict() == config.to_dict()
