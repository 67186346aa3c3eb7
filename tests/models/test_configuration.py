"""configuration/: every file resolves by name, is listed in its README, and is valid for what reads it (transformers
for model configs, the jobs' parser for recipes, accelerate's own loader for Accelerate configs); twins differ only
where they should. The configs that run on CPU run in tests/robustness/test_distributed.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from transformers import AutoConfig, HfArgumentParser

import modeling_plat
from plat_train import presets
from plat_train.arguments import PlatTrainingArguments, parse_args
from plat_train.causal_lm import TextDataArguments
from plat_train.causal_lm import TextModelArguments
from plat_train.image_classification import AugmentArguments, ImageModelArguments
from plat_train.image_classification import ImageDataArguments

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = ROOT / "configuration"
FILES = sorted(path.relative_to(CONFIGURATION) for path in CONFIGURATION.rglob("*.*") if path.name != "README.md")
RECIPES = sorted((CONFIGURATION / "recipes").glob("*.yaml"))
ACCELERATE = sorted((CONFIGURATION / "accelerate").glob("*.yaml"))
PROCESSORS = sorted((CONFIGURATION / "processors").glob("*.json"))


def test_the_repository_folder_is_the_one_names_resolve_to():
    assert presets.CONFIGURATION_DIR == CONFIGURATION
    assert presets.resolve_config_name("plat-ptb-tiny") == str(CONFIGURATION / "models/plat-ptb-tiny.json")
    assert presets.resolve_preset("plat-ptb-tiny.yaml", "training recipe", "flag") == str(
        CONFIGURATION / "recipes/plat-ptb-tiny.yaml")
    user_file = str(CONFIGURATION / "models/plat-ptb-tiny.json")  # any existing path is taken as given
    assert presets.resolve_config_name(user_file) == user_file
    with pytest.raises(ValueError, match="softmax-ptb-tiny"):  # an unknown name lists the shipped ones
        presets.resolve_config_name("plat-ptb-huge")


def test_every_file_has_a_row_in_the_readme():
    readme = (CONFIGURATION / "README.md").read_text()
    assert [str(path) for path in FILES if f"`{path}`" not in readme] == []


@pytest.mark.parametrize("name", ["accelerate/fsdp", "multi-node", "plat-ptb-tiny.yaml", "softmax-fmnist-tiny",
                                  "processors/plat-fmnist-tiny"])
def test_the_command_line_prints_a_configuration_path(name):
    printed = subprocess.run([sys.executable, "-m", "plat_train.presets", name], capture_output=True, text=True,
                             check=True, timeout=120).stdout.strip()
    assert Path(printed).is_file() and Path(printed).parent.parent == CONFIGURATION


@pytest.mark.parametrize("path", PROCESSORS, ids=lambda path: path.stem)
def test_image_processor_presets_fit_their_model_preset_and_its_twin(path):
    model = json.loads((CONFIGURATION / "models" / path.name).read_text())
    fields = json.loads(path.read_text())
    assert set(fields) == {"image_mean", "image_std"}
    assert len(fields["image_mean"]) == len(fields["image_std"]) == model["num_channels"]
    variant, _, size = path.stem.partition("-")
    assert json.loads(path.with_name(f"{'softmax' if variant == 'plat' else 'plat'}-{size}.json").read_text()) == fields
    # by name, and by the shipped file's path
    assert presets.image_processor_preset(path.stem) == fields
    assert presets.image_processor_preset(str(CONFIGURATION / "models" / path.name)) == fields


def test_other_configs_get_no_image_processor_preset(tmp_path):
    copy = tmp_path / "plat-fmnist-tiny.json"  # a user's own file, whatever its name
    copy.write_text((CONFIGURATION / "models" / "plat-fmnist-tiny.json").read_text())
    assert presets.image_processor_preset(str(copy)) == {}
    assert presets.image_processor_preset("plat-deit-tiny") == {}


@pytest.mark.parametrize("path", sorted((CONFIGURATION / "models").glob("*.json")), ids=lambda path: path.stem)
def test_model_configs_load_and_twins_differ_only_in_p(path):
    assert isinstance(AutoConfig.from_pretrained(path), modeling_plat.PlatConfigBase)
    variant, _, size = path.stem.partition("-")
    fields = json.loads(path.read_text())
    twin = json.loads(path.with_name(f"{'softmax' if variant == 'plat' else 'plat'}-{size}.json").read_text())
    assert {key for key in fields.keys() | twin.keys() if fields.get(key) != twin.get(key)} == {"plap_p"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_recipes_parse_for_their_job(path):
    model = json.loads(Path(presets.resolve_config_name(yaml.safe_load(path.read_text())["config_name"])).read_text())
    text = model["architectures"] == ["PlatForCausalLM"]
    job = (TextModelArguments, TextDataArguments) if text else (ImageModelArguments, ImageDataArguments,
                                                                  AugmentArguments)
    model_args = parse_args(HfArgumentParser((*job, PlatTrainingArguments)), [path.name])[0]
    assert Path(presets.resolve_config_name(model_args.config_name)).is_file()


def test_twin_recipes_differ_in_the_model_and_the_learning_rate_the_study_chose():
    """The study (results/README.md) chose 1e-3 for softmax on both tasks, 3e-3 for the p-LaT mix on PTB and 1e-3
    on Fashion-MNIST; its amendment chose 3e-3 for both arms of the Llama-shaped PTB model."""
    chosen = {"plat-ptb-tiny": 3e-3, "softmax-ptb-tiny": 1e-3, "plat-fmnist-tiny": 1e-3, "softmax-fmnist-tiny": 1e-3,
              "plat-llama-tiny": 3e-3, "softmax-llama-tiny": 3e-3}
    recipes = {path.stem: yaml.safe_load(path.read_text()) for path in RECIPES}
    assert {name: float(recipes[name]["learning_rate"]) for name in chosen} == chosen
    for name, recipe in recipes.items():
        if name.startswith("plat-"):
            twin = recipes[name.replace("plat-", "softmax-", 1)]
            assert {key for key in recipe if twin[key] != recipe[key]} <= {"config_name", "output_dir", "learning_rate"}


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda path: path.stem)
def test_accelerate_configs_pass_accelerates_own_loader(path):
    config = load_config_from_file(str(path))  # unknown keys and bad values raise
    assert config.num_processes >= 1 and config.mixed_precision == "no"  # the scripts' --bf16 / --fp16 decide


def test_fsdp_shards_fully_by_layer_and_saves_loadable_checkpoints():
    fsdp = load_config_from_file(str(CONFIGURATION / "accelerate/fsdp.yaml")).fsdp_config
    assert fsdp["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    # The wrapped class exists and is a unit transformers keeps whole, in both families.
    assert hasattr(modeling_plat.modeling_plat, fsdp["fsdp_transformer_layer_cls_to_wrap"])
    for model_class in (modeling_plat.PlatForCausalLM, modeling_plat.PlatForImageClassification):
        assert fsdp["fsdp_transformer_layer_cls_to_wrap"] in model_class._no_split_modules
    # A full state dict gathered on save: save_pretrained writes an ordinary checkpoint, not per-rank shards.
    assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"


def test_multi_node_template_names_the_rendezvous():
    config = load_config_from_file(str(CONFIGURATION / "accelerate/multi-node.yaml"))
    assert config.num_machines > 1 and config.num_processes % config.num_machines == 0
    assert config.main_process_ip and config.main_process_port and config.machine_rank == 0
