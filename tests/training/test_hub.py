"""push_to_hub from the training scripts, with the upload intercepted: the exact files that would be sent,
and a model card that describes the pushed model."""

import importlib
import re
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import yaml

import transformers.trainer
from transformers.dynamic_module_utils import get_relative_import_files
from tiny import run_without_plugin

ROOT = Path(__file__).resolve().parents[2]
# The remote code transformers itself would copy for the model class: its file and every relative import in it.
MODELING_FILES = {Path(f).name for f in [ROOT / "modeling_plat" / "modeling_plat.py",
                                         *get_relative_import_files(ROOT / "modeling_plat" / "modeling_plat.py")]}
RESULT_FILES = {"all_results.json", "train_results.json", "trainer_state.json",
                "training_args.bin"}


def load_script(name):
    """The job a top-level script starts."""
    return importlib.import_module({"run_clm": "plat_train.causal_lm",
                                    "run_image_classification": "plat_train.image_classification"}[name])


class FakeHub:
    """Stands in for huggingface_hub.HfApi: records what Trainer would create and upload."""

    def __init__(self):
        self.repos, self.uploads = [], []

    def create_repo(self, repo_id, **kwargs):
        self.repos.append(repo_id)
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"someone/{repo_id}")

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), **kwargs):
        root = Path(folder_path)
        files = set()
        for path in root.rglob("*"):
            relative = path.relative_to(root).as_posix()
            if path.is_file() and not any(fnmatch(part, pattern) for part in relative.split("/")
                                          for pattern in ignore_patterns):
                files.add(relative)
        self.uploads.append((repo_id, files))


@pytest.fixture
def hub(monkeypatch):
    fake = FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: fake)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # reachable, as far as the jobs know
    monkeypatch.setattr(huggingface_hub, "whoami", lambda token=None: {"name": "someone"})  # logged in
    return fake


@pytest.mark.parametrize("script", ["run_clm", "run_image_classification"])
def test_push_to_hub_in_offline_mode_is_refused_with_the_arguments(script, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    output_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        load_script(script).main(["--do_train", "--output_dir", str(output_dir), "--push_to_hub",
                                  "--hub_model_id", "someone/plat"])  # fmt: skip
    assert exited.value.code == 2
    assert "offline mode is on (HF_HUB_OFFLINE): drop --push_to_hub" in capsys.readouterr().err
    assert not output_dir.exists()


def hub_failure(kind):
    """The error huggingface_hub.whoami raises without a token, with one the Hub refuses, and without a connection."""
    # The HTTP library the Hub client raises from (httpx2 today), found through the Hub's own error class.
    http = importlib.import_module(huggingface_hub.errors.HfHubHTTPError.__mro__[1].__module__)
    if kind == "no token":
        return huggingface_hub.errors.LocalTokenNotFoundError("Token is required to call the /whoami-v2 endpoint")
    if kind == "refused":
        response = http.Response(401, request=http.Request("GET", "https://huggingface.co/api/whoami-v2"))
        return huggingface_hub.errors.HfHubHTTPError("401 Client Error: Unauthorized", response=response)
    return http.ConnectError("[Errno -2] Name or service not known")


@pytest.mark.parametrize("kind, message", [
    ("no token", "needs a Hugging Face token: log in (hf auth login), set HF_TOKEN or pass --hub_token; or drop"),
    ("refused", "the Hugging Face Hub refused the token (401 Client Error: Unauthorized); log in again"),
    ("unreachable", "could not be reached (ConnectError: [Errno -2] Name or service not known): check the network"),
])  # fmt: skip
def test_push_to_hub_that_the_hub_cannot_take_is_refused_with_the_arguments(kind, message, monkeypatch, tmp_path,
                                                                           capsys):  # fmt: skip
    """Before the data load: Trainer would fail creating the repository once the data and model were ready."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def whoami(token=None):
        assert token == "hf_given"  # --hub_token, else the Hub client's own (HF_TOKEN, the login)
        raise hub_failure(kind)

    monkeypatch.setattr(huggingface_hub, "whoami", whoami)
    output_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        load_script("run_clm").main(["--do_train", "--output_dir", str(output_dir), "--push_to_hub", "--hub_token",
                                     "hf_given"])  # fmt: skip
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not output_dir.exists()


def card_of(folder):
    text = (Path(folder) / "README.md").read_text()
    metadata = yaml.safe_load(re.match(r"---\n(.*?)\n---\n", text, re.S).group(1))
    return metadata, text


def test_image_script_pushes_weights_code_processor_and_card(hub, tmp_path):
    from test_run_image_classification import folder_args, make_folder

    folders = make_folder(tmp_path / "train"), make_folder(tmp_path / "validation", per_class=3, seed=1)
    output_dir = tmp_path / "out"
    load_script("run_image_classification").main([str(a) for a in folder_args(
        folders, output_dir, "--do_train", "--do_eval", "--max_steps", 2, "--save_strategy", "no",
        "--push_to_hub", "--hub_model_id", "someone/plat-shapes",
    )])
    assert hub.repos == ["someone/plat-shapes"]
    assert {repo_id for repo_id, _ in hub.uploads} == {"someone/plat-shapes"}
    files = hub.uploads[-1][1]  # Trainer pushes on save_model too; the last upload is the final state
    expected = MODELING_FILES | RESULT_FILES | {"config.json", "model.safetensors", "preprocessor_config.json",
                                                "README.md", "eval_results.json"}
    assert files == expected
    metadata, text = card_of(output_dir)
    assert metadata["pipeline_tag"] == "image-classification" and "plat" in metadata["tags"]
    assert "| validation | Top-1 accuracy |" in text and 'model="someone/plat-shapes"' in text


def test_clm_script_pushes_weights_code_tokenizer_and_card(hub, tmp_path):
    from tiny import FAST, TINY_MODEL, write_lines

    train, validation = write_lines(tmp_path / "train.txt", 100), write_lines(tmp_path / "valid.txt", 20, seed=1)
    output_dir = tmp_path / "out"
    load_script("run_clm").main([
        *TINY_MODEL, *FAST, "--train_file", str(train), "--validation_file", str(validation), "--do_train",
        "--do_eval", "--max_steps", "2", "--save_strategy", "no", "--output_dir", str(output_dir),
        "--push_to_hub", "--hub_model_id", "someone/plat-words",
    ])
    assert hub.repos == ["someone/plat-words"]
    assert {repo_id for repo_id, _ in hub.uploads} == {"someone/plat-words"}
    expected = MODELING_FILES | RESULT_FILES | {"config.json", "generation_config.json", "model.safetensors",
                                                "tokenizer.json", "tokenizer_config.json", "README.md",
                                                "eval_results.json"}
    assert hub.uploads[-1][1] == expected
    metadata, text = card_of(output_dir)
    assert metadata["pipeline_tag"] == "text-generation" and "plat" in metadata["tags"]
    assert "| validation | Perplexity |" in text and 'model="someone/plat-words"' in text


@pytest.mark.parametrize("channels", [3, 1])
def test_image_card_snippet_runs_without_the_plugin(tmp_path, channels):
    """The saved folder's card snippet, run as printed in a fresh process where plat cannot be imported."""
    from test_run_image_classification import TINY_GRAY, TINY_RGB, folder_args, make_folder

    folders = make_folder(tmp_path / "train", per_class=3), make_folder(tmp_path / "validation", per_class=2)
    output_dir = tmp_path / "out"
    overrides = TINY_RGB if channels == 3 else TINY_GRAY
    load_script("run_image_classification").main([str(a) for a in folder_args(
        folders, output_dir, "--do_train", "--max_steps", 1, "--save_strategy", "no", "--config_overrides",
        overrides,
    )])
    snippet = re.search(r"```python\n(.*?)```", (output_dir / "README.md").read_text(), re.S).group(1)
    result = run_without_plugin(snippet, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(label in result.stdout for label in ("circle", "square", "stripes"))
