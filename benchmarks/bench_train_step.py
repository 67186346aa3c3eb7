"""One optimizer step (forward, backward, AdamW) of p-LaT models against their softmax baselines.

Pairs, each timed as the median of --repeats steps after --warmup steps, round-robin within a repeat:
- vision: p-LaT DeiT-tiny/16 (12 layers x 192, 3 heads, p = 1.5, 1.5, 2.5; 224px, 1000 classes) vs
  transformers' ViTForImageClassification of the same sizes with SDPA attention, and p-LaT with p = 2;
- lm: the paper's p-LaT LM (16 layers x 128, 8 heads, context 256, p = 4 x 1.5 + 4 x 2.5; 10k vocabulary)
  vs GPT2LMHeadModel of the same sizes with SDPA attention, and p-LaT with p = 2;
- ptb: the plat-ptb-tiny preset's model (4 layers x 128, 8 heads, context 128, p = 4 x 1.5 + 4 x 2.5, 10k
  vocabulary, hidden dropout 0.1; batch 32) vs its softmax-ptb-tiny twin (the same with p = 2);
- compile, compile-llama: the plat-ptb-tiny / plat-llama-tiny preset's model (10k vocabulary) under
  torch.compile(fullgraph=True) vs the same model eager (the warm-up steps compile; use --warmup 2 or more);
- llama-125m (not run by default: a GPU-sized pair): a Llama-shaped p-LaT LM (12 layers x 768, 12 heads, rotary,
  RMSNorm, SwiGLU 2048, paper p mix; 32k vocabulary, 1024 tokens, untied head: 134M parameters) vs
  LlamaForCausalLM of the same sizes with SDPA attention; batch 8.
Attention dropout is 0 everywhere (it would route p-LaT to the eager reference); hidden dropout is 0 except
in the ptb pair, which copies its presets. Language models read token ids drawn by Zipf's law, as a text's words
repeat (``zipf_tokens``): in the rotary models' first layer equal tokens have equal values, pairs at distance zero
that the fused kernels take through their exact passes on a GPU. Each printed ratio carries the machine it was
measured on.

    python benchmarks/bench_train_step.py --pairs vision lm ptb --threads 1 --repeats 5
    python benchmarks/bench_train_step.py --pairs vision lm --out results/train_step
    python benchmarks/bench_train_step.py --pairs compile compile-llama --warmup 3 --repeats 10
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageClassification, GPT2Config, LlamaConfig, ViTConfig

from machine import facts_label, machine_facts
from modeling_plat import PlatConfig, PlatForCausalLM, PlatForImageClassification, PlatVisionConfig, paper_p_mix
from plat_train.presets import resolve_config_name

DEIT_TINY = dict(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768)
PAPER_LM = dict(hidden_size=128, num_hidden_layers=16, num_attention_heads=8, intermediate_size=512)
PTB_TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, intermediate_size=512)
LLAMA_125M = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, intermediate_size=2048, hidden_act="silu", max_position_embeddings=1024,
                  rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
# Tokens of each language-model pair's rows: (length, vocabulary); the others' rows are 128 of 10k.
TOKENS = {"lm": (256, 10000), "llama-125m": (1024, 32000)}


def vision_models(backend):
    plat = dict(**DEIT_TINY, image_size=224, patch_size=16, num_channels=3, num_labels=1000, plap_backend=backend)
    vit = ViTConfig(**DEIT_TINY, image_size=224, patch_size=16, num_labels=1000, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)  # fmt: skip
    return {
        "plat-deit-tiny": PlatForImageClassification(PlatVisionConfig(**plat, plap_p=[1.5, 1.5, 2.5])),
        "plat-deit-tiny-p2": PlatForImageClassification(PlatVisionConfig(**plat, plap_p=2.0)),
        "vit-deit-tiny-sdpa": AutoModelForImageClassification.from_config(vit, attn_implementation="sdpa"),
    }


def lm_models(backend):
    plat = dict(**PAPER_LM, vocab_size=10000, max_position_embeddings=256, plap_backend=backend)
    gpt2 = GPT2Config(vocab_size=10000, n_embd=128, n_layer=16, n_head=8, n_inner=512, n_positions=256,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return {
        "plat-lm": PlatForCausalLM(PlatConfig(**plat, plap_p=[1.5] * 4 + [2.5] * 4)),
        "plat-lm-p2": PlatForCausalLM(PlatConfig(**plat, plap_p=2.0)),
        "gpt2-lm-sdpa": AutoModelForCausalLM.from_config(gpt2, attn_implementation="sdpa"),
    }


def ptb_models(backend):
    plat = dict(**PTB_TINY, vocab_size=10000, max_position_embeddings=128, hidden_dropout_prob=0.1,
                attention_probs_dropout_prob=0.0, plap_backend=backend)  # fmt: skip
    return {
        "plat-ptb-tiny": PlatForCausalLM(PlatConfig(**plat, plap_p=[1.5] * 4 + [2.5] * 4)),
        "softmax-ptb-tiny": PlatForCausalLM(PlatConfig(**plat, plap_p=2.0)),
    }


def llama_models(backend):
    plat = dict(**LLAMA_125M, position_embedding_type="rope", norm_type="rmsnorm", mlp_type="gated",
                hidden_dropout_prob=0.0, plap_backend=backend)  # fmt: skip
    return {
        "plat-llama-125m": PlatForCausalLM(PlatConfig(**plat, plap_p=paper_p_mix(12))),
        "llama-125m-sdpa": AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_125M), attn_implementation="sdpa"),
    }


def compile_pair(preset, **options):
    """A preset's model under torch.compile (fullgraph; ``options``: more of torch.compile's arguments) against
    the same model run eagerly."""

    def build(backend):
        config = PlatConfig.from_json_file(resolve_config_name(preset))
        config.vocab_size, config.plap_backend = 10000, backend
        compiled, eager = PlatForCausalLM(config), PlatForCausalLM(config)
        eager.load_state_dict(compiled.state_dict())
        return {f"{preset}-compiled": torch.compile(compiled, fullgraph=True, **options), f"{preset}-eager": eager}

    return build


PAIRS = {"vision": (vision_models, 8), "lm": (lm_models, 16), "ptb": (ptb_models, 32),
         "compile": (compile_pair("plat-ptb-tiny"), 32), "compile-llama": (compile_pair("plat-llama-tiny"), 32),
         "llama-125m": (llama_models, 8)}


def zipf_tokens(batch, length, vocab, generator, device=None):
    """(batch, length) token ids drawn as a text's are by Zipf's law, the token of rank r with a frequency of 1 / r:
    repeated within a row as words are, so that a rotary model's first layer meets equal values (pairs that the fused
    kernels' exact passes take), which uniform ids rarely give."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32, device=device)
    return torch.multinomial((1 / ranks).expand(batch, -1), length, replacement=True, generator=generator)


def batches(pair, batch_size):
    gen = torch.Generator().manual_seed(0)
    if pair == "vision":
        pixels = torch.randn(batch_size, 3, 224, 224, generator=gen)
        return dict(pixel_values=pixels, labels=torch.randint(0, 1000, (batch_size,), generator=gen))
    length, vocab = TOKENS.get(pair, (128, 10000))
    tokens = zipf_tokens(batch_size, length, vocab, gen)
    return dict(input_ids=tokens, labels=tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", nargs="+", choices=list(PAIRS),
                        default=[pair for pair in PAIRS if pair != "llama-125m"])
    parser.add_argument("--batch", type=int, help="batch size of every pair (default: 8 vision, 16 lm, 32 ptb, "
                        "8 llama-125m)")
    parser.add_argument("--backend", default="auto", help="plap_backend of the p-LaT models")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: PyTorch's choice)")
    parser.add_argument("--out", type=Path, help="directory for train_step.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    facts = machine_facts(torch.device("cpu"))
    env = dict(**facts, backend=args.backend, warmup=args.warmup, repeats=args.repeats,
               load_average_before=os.getloadavg())  # fmt: skip
    print(json.dumps(env))
    label = facts_label(facts)
    results = {}
    for pair in args.pairs:
        build_models, default_batch = PAIRS[pair]
        models = build_models(args.backend)
        inputs = batches(pair, args.batch or default_batch)
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
        times = {name: [] for name in models}
        for step in range(args.warmup + args.repeats):
            for name, model in models.items():
                model.train()
                start = time.perf_counter()
                model(**inputs).loss.backward()
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        names = list(models)
        baseline = statistics.median(times[names[-1]])
        for name in names:
            median = statistics.median(times[name])
            spread = (min(times[name]) / baseline, max(times[name]) / baseline)
            results[name] = dict(pair=pair, step_s=median, ratio=median / baseline, baseline=names[-1],
                                 ratio_range=spread, **facts)  # fmt: skip
            print(f"{name:<20} {median:8.3f} s/step  {median / baseline:5.2f} x {names[-1]:<20} {label}")
    env["load_average_after"] = os.getloadavg()
    print(f"load average before {env['load_average_before']}, after {env['load_average_after']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train_step.json").write_text(json.dumps(dict(environment=env, results=results), indent=2))


if __name__ == "__main__":
    main()
