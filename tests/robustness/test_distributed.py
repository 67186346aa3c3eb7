"""Distributed training computes what one process computes: FSDP with one unit per module class named in
``_no_split_modules``, and both scripts under two-process DDP (torchrun and accelerate launch, gloo) against a
single process with the same global batch (losses, gradient norms, evaluation, sliding-window scores), every process
exiting cleanly and the checkpoint that rank 0 saves reloading. Each step here uses the whole training
set, so data order cannot make a difference. Launches that could not train as one job are refused before
training."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny import ACCELERATE_CONFIGS, free_port, two_processes, write_lines
from transformers import AutoModelForCausalLM, AutoTokenizer

from plat_train.arguments import PlatTrainingArguments
from plat_train.runs import check_launch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "tests")}
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo on Linux/macOS")
without_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")


def launch(script, *args, launcher=None):
    """``script`` in one process, or in two under ``launcher`` (torchrun or accelerate)."""
    command = [*(two_processes(launcher) if launcher else [sys.executable]), str(script), *map(str, args)]
    if launcher and script.name.startswith("run_"):
        command += ["--ddp_backend", "gloo"]
    completed = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    # Exit status 0 from every process, the last of them after its interpreter has shut down.
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed.stdout


@pytest.mark.parametrize("family, units", [("text", ["PlatLayer"] * 2),
                                           ("vision", ["PlatLayer"] * 2 + ["PlatVisionEmbeddings"])])
def test_fsdp_wraps_no_split_modules_and_matches_one_process(family, units):
    report = json.loads(launch(HERE / "sharded_training_worker.py", family, launcher="torchrun").strip().splitlines()[-1])
    assert report["units"] == units
    assert report["local_fraction"] < 0.6  # each rank holds about half of the parameters
    assert report["sharded"] == pytest.approx(report["single"], rel=1e-5)
    assert report["sharded"][-1] < report["sharded"][0]


def training_record(output_dir):
    """The loss and gradient norm of every step, and the final evaluation loss."""
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    steps = [(entry["loss"], entry["grad_norm"]) for entry in history if "loss" in entry]
    return steps, json.loads((Path(output_dir) / "all_results.json").read_text())["eval_loss"]


def assert_same_training(single_dir, ddp_dir):
    (single_steps, single_eval), (ddp_steps, ddp_eval) = training_record(single_dir), training_record(ddp_dir)
    assert len(ddp_steps) == len(single_steps) == 3
    assert np.allclose(ddp_steps, single_steps, rtol=1e-5, atol=0)
    assert ddp_eval == pytest.approx(single_eval, rel=1e-5)


@pytest.fixture(scope="module")
def text_job(tmp_path_factory):
    """run_clm.py's arguments on a few lines of random words, saving a checkpoint and scoring by sliding windows, and
    the output folder of their run in one process (8 sequences per step), which each launcher's run is compared with."""
    folder = tmp_path_factory.mktemp("text-job")
    write_lines(folder / "train.txt", 60, seed=0)
    write_lines(folder / "validation.txt", 20, seed=1)
    common = ["--model_type", "plat", "--config_overrides",
              "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,max_position_embeddings=16",
              "--train_file", folder / "train.txt", "--validation_file", folder / "validation.txt",
              "--tokenizer_type", "word", "--max_train_samples", 8, "--do_train", "--do_eval", "--max_steps", 3,
              "--learning_rate", 3e-3, "--max_eval_samples", 8, "--per_device_eval_batch_size", 4, "--seed", 7,
              "--report_to", "none", "--save_steps", 3, "--logging_steps", 1, "--eval_stride", 4,
              "--sliding_window_batch_size", 8, "--use_cpu"]  # fmt: skip
    launch(ROOT / "run_clm.py", *common, "--per_device_train_batch_size", 8, "--output_dir", folder / "single")
    return common, folder / "single"


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_run_clm_two_process_ddp_matches_one_process(launcher, text_job, tmp_path):
    common, single_dir = text_job
    # Full batches everywhere (training and evaluation), so that means over batches are means over examples.
    output = launch(ROOT / "run_clm.py", *common, "--per_device_train_batch_size", 4, "--output_dir", tmp_path,
                    launcher=launcher)  # fmt: skip
    assert "Process rank 1," in output
    assert_same_training(single_dir, tmp_path)
    sliding = [json.loads((folder / "all_results.json").read_text()) for folder in (single_dir, tmp_path)]
    assert sliding[1]["eval_sliding_tokens"] == sliding[0]["eval_sliding_tokens"] > 0
    assert sliding[1]["eval_sliding_perplexity"] == pytest.approx(sliding[0]["eval_sliding_perplexity"], rel=1e-5)
    # The checkpoint that rank 0 saved reloads with the tokenizer the job trained.
    assert json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-3")
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(tmp_path))


def test_sigterm_to_one_process_stops_both_at_one_checkpoint(text_job, tmp_path):
    """--enable_jit_checkpoint under torchrun, SIGTERM to rank 1 alone (a node preempted before the others): both
    processes stop at the same step and save it whole, the job ends instead of hanging, and the same command resumes
    from that step to the end."""
    import signal
    import time

    import psutil

    common, _ = text_job
    script = ROOT / "run_clm.py"
    flags = [*map(str, common), "--per_device_train_batch_size", "4", "--max_steps", "100", "--save_steps", "4",
             "--enable_jit_checkpoint", "true", "--output_dir", str(tmp_path)]  # fmt: skip
    launcher = subprocess.Popen([*two_processes("torchrun"), str(script), *flags, "--ddp_backend", "gloo"], cwd=ROOT,
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "checkpoint-4" / "trainer_state.json").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.01)
        rank_1 = [worker for worker in psutil.Process(launcher.pid).children(recursive=True)
                  if worker.environ().get("RANK") == "1"]  # fmt: skip
        assert len(rank_1) == 1
        rank_1[0].send_signal(signal.SIGTERM)
        output = launcher.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        pytest.fail("the processes did not end after one of them got SIGTERM: " + launcher.communicate()[0][-3000:])
    step = max(int(folder.name.removeprefix("checkpoint-")) for folder in tmp_path.glob("checkpoint-*"))
    assert f"Training stopped on SIGTERM at step {step} of 100" in output and 4 < step < 100, output[-3000:]
    newest = tmp_path / f"checkpoint-{step}"
    assert json.loads((newest / "trainer_state.json").read_text())["global_step"] == step
    assert (newest / "rng_state_0.pth").is_file() and (newest / "rng_state_1.pth").is_file()
    assert not (tmp_path / "all_results.json").exists()

    output = launch(script, *flags, launcher="torchrun")
    assert f"resuming training at {newest}" in output
    assert json.loads((tmp_path / "trainer_state.json").read_text())["global_step"] == 100


def write_square_images(root, per_class, seed):
    """Square images, so that a crop of the whole area (crop_scale_min 1) is the only crop: no augmentation."""
    rng = np.random.default_rng(seed)
    for label, brightness in (("dark", 40), ("light", 200)):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 50, (20, 20, 3)) + brightness
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(root / label / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def image_job(tmp_path_factory):
    """run_image_classification.py's arguments on square images (no augmentation), and the output folder of their run
    in one process (12 images per step)."""
    folder = tmp_path_factory.mktemp("image-job")
    common = ["--train_dir", write_square_images(folder / "train", 6, 0),
              "--validation_dir", write_square_images(folder / "validation", 3, 1),
              "--config_name", "plat-deit-tiny", "--config_overrides",
              "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,plap_p=[1.5,2.5],"
              "image_size=16,patch_size=4", "--crop_scale_min", 1.0, "--hflip_prob", 0.0, "--do_train", "--do_eval",
              "--max_steps", 3, "--learning_rate", 3e-3, "--per_device_eval_batch_size", 3, "--seed", 7,
              "--report_to", "none", "--save_strategy", "no", "--logging_steps", 1, "--dataloader_num_workers", 0,
              "--use_cpu"]
    launch(ROOT / "run_image_classification.py", *common, "--per_device_train_batch_size", 12,
           "--output_dir", folder / "single")  # fmt: skip
    return common, folder / "single"


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_run_image_classification_two_process_ddp_matches_one_process(launcher, image_job, tmp_path):
    common, single_dir = image_job
    launch(ROOT / "run_image_classification.py", *common, "--per_device_train_batch_size", 6, "--output_dir", tmp_path,
           launcher=launcher)  # fmt: skip
    assert_same_training(single_dir, tmp_path)


def tiny_text_job(folder):
    """Arguments of a run_clm.py job on a few lines of text, without --use_cpu."""
    (folder / "train.txt").write_text("the cat sat on the mat\nthe dog ran under the tree\n" * 20)
    return ["--model_type", "plat", "--config_overrides",
            "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,max_position_embeddings=16",
            "--train_file", folder / "train.txt", "--tokenizer_type", "word", "--do_train", "--max_steps", 2,
            "--report_to", "none", "--output_dir", folder / "out"]


def tiny_image_job(folder):
    """Arguments of a run_image_classification.py job on a few images, without --use_cpu."""
    return ["--train_dir", write_square_images(folder / "train", 2, 0), "--config_name", "plat-deit-tiny",
            "--config_overrides", "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,"
            "plap_p=[1.5,2.5],image_size=16,patch_size=4", "--do_train", "--max_steps", 2, "--report_to", "none",
            "--output_dir", folder / "out"]  # fmt: skip


JOBS = {"run_clm.py": tiny_text_job, "run_image_classification.py": tiny_image_job}


def assert_refused(command, script, folder, message):
    """``command`` launching ``script`` (a key of JOBS) on its tiny job stops with ``message`` before any output."""
    completed = subprocess.run([*command, str(ROOT / script), *map(str, JOBS[script](folder))], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert completed.returncode != 0
    assert message in completed.stderr, completed.stderr[-3000:]
    assert not (folder / "out").exists()  # refused before anything was trained or written


# Both jobs run the same launch check: one refusal each keeps the suite short.
@without_gpu
def test_two_processes_without_use_cpu_refuse_before_training(tmp_path):
    """cpu-2-processes.yaml without --use_cpu would start two unsynchronised trainings that both think they are
    rank 0."""
    assert_refused(two_processes("accelerate"), "run_image_classification.py", tmp_path, "pass --use_cpu")


@without_gpu
def test_multi_gpu_config_refuses_on_a_machine_without_a_gpu(tmp_path):
    # Two processes instead of the config's eight keep the test quick; the refusal does not depend on the count.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ACCELERATE_CONFIGS / "multi-gpu.yaml"), "--num_processes", "2", "--main_process_port",
               str(free_port())]
    assert_refused(command, "run_clm.py", tmp_path, "this machine has no GPU")


def test_more_processes_than_gpus_on_a_machine_are_refused(monkeypatch, tmp_path):
    """As torchrun --nproc_per_node 4 would set it up on a machine with 2 GPUs."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="4 processes were launched on this machine but it has 2 GPU"):
        check_launch(PlatTrainingArguments(output_dir=str(tmp_path)))
