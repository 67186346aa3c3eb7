"""What ships: the model package is exactly a checkpoint's remote code (it imports nothing of the training side),
the repository's modules import one another without cycles, and the wheel, installed on its own, runs a preset by
name from a directory outside the repository."""

import ast
import json
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Everything the modeling package may import besides the standard library and itself.
MODELING_RUNTIME = {"torch", "transformers", "safetensors", "numpy", "triton"}
# The training side and the dependencies only it brings (pyyaml and tokenizers come with transformers itself).
TRAINING_SIDE = ("plat_train", "datasets", "accelerate", "treebank", "matplotlib", "scipy")
SOURCE_FOLDERS = ("modeling_plat", "plat_train", "experiments", "benchmarks", "benchmarks/gpu_sections",
                  "tools/kernels")


def module_name(path):
    """The dotted name a repository file is imported by (experiments/, benchmarks/ and tools/kernels/ are folders of
    scripts)."""
    relative = path.relative_to(ROOT).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


def imported_names(path):
    """(dotted name, line) of every import in a file, relative ones resolved against its package."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.append((base, node.lineno))
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]  # `from . import x`
    return names


def repository_modules():
    files = [p for folder in SOURCE_FOLDERS for p in sorted((ROOT / folder).glob("*.py"))]
    return {module_name(p): p for p in files + sorted(ROOT.glob("run_*.py"))}


def local_target(name, modules, importer):
    """The repository module an import name refers to, or None for outside code."""
    if name in modules:
        return name
    # Scripts in experiments/, benchmarks/ and tools/kernels/ import their siblings by bare name.
    sibling = f"{importer.rpartition('.')[0]}.{name}" if "." in importer else None
    return sibling if sibling in modules else None


def test_modeling_package_imports_only_its_runtime():
    offenders = []
    for path in sorted((ROOT / "modeling_plat").glob("*.py")):
        for name, line in imported_names(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "modeling_plat":
                continue
            if top not in MODELING_RUNTIME or (top == "triton" and path.name != "triton_tiles.py"):
                offenders.append(f"{path.name}:{line} imports {name}")
    assert not offenders, offenders


def test_modeling_package_imports_without_the_training_side():
    """Import and use the model package with the training side and its dependencies made unimportable; our Triton
    kernels are not loaded until they are asked for (torch may load Triton itself)."""
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in TRAINING_SIDE)
        + "import torch, modeling_plat\n"
        "model = modeling_plat.PlatForCausalLM(modeling_plat.PlatConfig(vocab_size=11, hidden_size=8, "
        "num_hidden_layers=1, num_attention_heads=2))\n"
        "model(torch.randint(0, 11, (1, 5)))\n"
        "assert 'modeling_plat.triton_tiles' not in sys.modules, 'Triton kernels imported eagerly'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_no_two_modules_import_each_other():
    modules = repository_modules()
    graph = {name: {target for imported, _ in imported_names(path)
                    if (target := local_target(imported, modules, name)) and target != name}
             for name, path in modules.items()}
    # A package's __init__ is imported with its modules; edges into it are not loops of their own.
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for target in graph[node]:
            if state.get(target) == "open":
                cycles.append(trail[trail.index(target):] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles
    assert not any(module.startswith("plat_train") for module in graph["modeling_plat"] | set().union(
        *(graph[name] for name in graph if name.startswith("modeling_plat"))))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Built from a copy of what the distribution is made of: a build/ folder left in the checkout could add
    # files that no longer exist.
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("modeling_plat", "plat_train", "configuration"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(dist), str(source)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = dist.glob("plat_transformers-*.whl")
    return path


def test_wheel_holds_every_configuration_and_a_light_core(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
        entry_points = archive.read(metadata_name.replace("METADATA", "entry_points.txt")).decode()
    shipped = {f"plat_train/configuration/{path.relative_to(ROOT / 'configuration')}"
               for path in (ROOT / "configuration").rglob("*") if path.is_file()}
    assert shipped >= {"plat_train/configuration/models/plat-ptb-tiny.json",
                       "plat_train/configuration/recipes/plat-ptb-tiny.yaml",
                       "plat_train/configuration/accelerate/fsdp.yaml", "plat_train/configuration/README.md"}
    assert shipped | {"modeling_plat/image_processing_plat.py"} <= names
    assert not any(name.startswith("configuration/") for name in names)  # no top-level name of its own
    assert metadata["Name"] == "plat-transformers"
    core = {req.split(">")[0].split("=")[0].split("<")[0].strip().lower()
            for req in metadata.get_all("Requires-Dist") if "extra ==" not in req}
    assert core == {"torch", "transformers", "safetensors", "huggingface_hub", "pillow"}
    for script in ("plat-run-clm", "plat-run-image-classification", "plat-convert"):
        assert script in entry_points


def test_wheel_runs_presets_by_name_outside_the_repository(wheel, tmp_path):
    # The wheel alone, installed into a folder that goes first on the running interpreter's path: its dependencies
    # (torch, transformers, ...) come from wherever this Python finds them, a virtual environment or a system-wide
    # install alike, and plat itself only from the wheel, not from the repository or an editable install.
    installed = tmp_path / "installed"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                              str(installed), str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": f"{installed / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(installed), "HF_HUB_OFFLINE": "1",
           "HOME": str(tmp_path)}

    where = subprocess.run([sys.executable, "-c", "import modeling_plat, plat_train.presets as p; "
                            "print(modeling_plat.__file__); print(p.CONFIGURATION_DIR)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr[-3000:]
    assert all(line.startswith(str(installed)) for line in where.stdout.split()), where.stdout

    # The main job's recipe by name, shortened by flags given after it.
    output = elsewhere / "run"
    result = subprocess.run(
        [str(installed / "bin" / "plat-run-clm"), "plat-ptb-tiny.yaml", "--max_steps", "2", "--max_train_samples", "8",
         "--max_eval_samples", "2", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "2",
         "--eval_stride", "128", "--save_strategy", "no", "--output_dir", str(output), "--disable_tqdm", "true"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((output / "config.json").read_text())
    assert config["model_type"] == "plat" and config["plap_p"] == [1.5] * 4 + [2.5] * 4
    assert "test_sliding_perplexity" in json.loads((output / "all_results.json").read_text())

    # A model preset by name through the other console script.
    result = subprocess.run(
        [str(installed / "bin" / "plat-run-image-classification"), "--config_name", "softmax-fmnist-tiny", "--do_train",
         "--max_steps", "2", "--max_train_samples", "16", "--per_device_train_batch_size", "8",
         "--output_dir", str(elsewhere / "image"), "--save_strategy", "no", "--report_to", "none"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((elsewhere / "image" / "config.json").read_text())
    assert config["model_type"] == "plat_vision" and config["plap_p"] == 2.0
