"""Tiny p-LaT models built from configs and tiny job arguments, shared by the test suites."""

import random
import socket
import struct
import subprocess
import sys
from pathlib import Path

import torch

from modeling_plat import PlatConfig, PlatForCausalLM, PlatForImageClassification, PlatVisionConfig

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = ROOT / "configuration/accelerate"

# transformers' own decoders with attn_implementation="plap": a tiny config that every family's class takes, token ids
# 0-2 special.
TINY_DECODER = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# run_clm.py on a tiny fresh model and a few lines of text (write_lines).
BLOCK = 16
TINY_MODEL = ["--model_type", "plat", "--config_overrides",
              f"hidden_size=32,num_hidden_layers=2,num_attention_heads=4,max_position_embeddings={BLOCK}"]
FAST = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--report_to", "none",
        "--logging_steps", "1"]
WORDS = "the a cat dog sat ran on under mat tree big small red blue quick slow and then it was".split()


def write_lines(path, num_lines, seed=0):
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(num_lines)]
    path.write_text("\n".join(lines) + "\n")
    return path


# A Llama-shaped decoder: rotary positions (a non-default theta), RMSNorm, SwiGLU, 2 key/value heads for 4 query
# heads, no biases, an untied LM head. Merged into text_config to give the same tests that shape.
LLAMA_SHAPE = dict(position_embedding_type="rope", rope_theta=500.0, norm_type="rmsnorm", mlp_type="gated",
                   hidden_act="silu", num_key_value_heads=2, qkv_bias=False, o_proj_bias=False, mlp_bias=False,
                   tie_word_embeddings=False)
TEXT_SHAPES = {"gpt2": {}, "llama": LLAMA_SHAPE}


def text_config(**kwargs):
    defaults = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=40, pad_token_id=0, eos_token_id=1)
    return PlatConfig(**(defaults | kwargs))


def vision_config(**kwargs):
    defaults = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=48,
                    image_size=16, patch_size=4, num_labels=5)
    return PlatVisionConfig(**(defaults | kwargs))


def lm(**kwargs):
    torch.manual_seed(0)
    return PlatForCausalLM(text_config(**kwargs)).eval()


def classifier(**kwargs):
    torch.manual_seed(0)
    return PlatForImageClassification(vision_config(**kwargs)).eval()


def train_losses(model, steps, lr, **inputs):
    """Losses of ``steps`` AdamW steps on one fixed batch (the model is put in training mode)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_without_plugin(code, folder, *args):
    """Run Python ``code`` in a fresh process where plat cannot be imported, as on a machine with transformers
    alone: checkpoints must then load through their own remote code."""
    script = Path(folder) / "without_plugin.py"
    script.write_text('import sys\nsys.modules["modeling_plat"] = sys.modules["plat_train"] = None\n' + code)
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(Path(folder) / "modules"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


def free_port():
    """A TCP port on the loopback that nothing listens on now, for torchrun's and accelerate's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_processes(launcher):
    """The command prefix that starts a script in two local processes with ``launcher`` (torchrun or accelerate)."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ACCELERATE_CONFIGS / "cpu-2-processes.yaml"), "--main_process_port", str(free_port())]
    raise ValueError(f"launcher must be 'torchrun' or 'accelerate', got {launcher!r}")


def tensorboard_scalars(log_dir):
    """{tag: [values]} of the scalars in the TensorBoard event files under ``log_dir``.

    Event files are TFRecords: each record is its length (uint64), a CRC of it, the serialised Event, a CRC.
    """
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(value.simple_value)
    return scalars
