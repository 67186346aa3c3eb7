"""Greedy decoding with the KV cache: p-LaT against transformers' own model of the same shape and sizes (SDPA).

``--shape gpt2`` (default): the plat-ptb-tiny sizes (4 layers x 128, 8 heads, p = 4 x 1.5 + 4 x 2.5, 10k
vocabulary, 256 positions) and its p = 2 twin, against GPT2LMHeadModel. ``--shape llama``: the plat-llama-tiny
sizes (8 query heads over 4 key/value heads, rotary positions, RMSNorm, SwiGLU 352, no biases) and its twin,
against LlamaForCausalLM. A 16-token prompt and --new_tokens greedy tokens (no early stop), batch 1 and 8. Each
repeat runs every model once, in a rotating order (interleaved pairs); the printed ratio is the transformers
model's tokens/s over each model's, medians over the repeats, beside the machine it was measured on.

    python benchmarks/bench_decode.py --repeats 7
    python benchmarks/bench_decode.py --shape llama --repeats 7
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from machine import facts_label, machine_facts
from modeling_plat import PlatConfig, PlatForCausalLM

COMMON = dict(vocab_size=10000, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
              max_position_embeddings=256, bos_token_id=0, eos_token_id=0)  # fmt: skip
LLAMA = dict(num_key_value_heads=4, intermediate_size=352, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
BASELINE = "transformers-sdpa"


def models(shape):
    """{name: model}: the p-LaT model, its p = 2 twin and transformers' model of the same sizes (BASELINE)."""
    if shape == "gpt2":
        plat = dict(**COMMON, intermediate_size=512, hidden_dropout_prob=0.0)
        baseline = GPT2Config(vocab_size=10000, n_embd=128, n_layer=4, n_head=8, n_inner=512, n_positions=256,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    else:
        plat = dict(**COMMON, **LLAMA, position_embedding_type="rope", norm_type="rmsnorm", mlp_type="gated",
                    attention_bias=False, mlp_bias=False, hidden_dropout_prob=0.0)  # fmt: skip
        baseline = LlamaConfig(**COMMON, **LLAMA)
    built = {
        f"plat-{shape}": PlatForCausalLM(PlatConfig(**plat, plap_p=[1.5] * 4 + [2.5] * 4)),
        f"softmax-{shape}": PlatForCausalLM(PlatConfig(**plat, plap_p=2.0)),
        BASELINE: AutoModelForCausalLM.from_config(baseline, attn_implementation="sdpa"),
    }
    return {name: model.eval() for name, model in built.items()}


def decode_seconds(model, prompt, new_tokens):
    synchronize = torch.cuda.synchronize if prompt.is_cuda else lambda: None  # the GPU's queue, inside the clock
    synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)  # fmt: skip
    synchronize()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new_tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: PyTorch's choice)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    label = facts_label(machine_facts(torch.device("cpu")))
    built = models(args.shape)
    names = list(built)
    results = {}
    for batch in args.batches:
        prompt = torch.randint(1, 10000, (batch, 16), generator=torch.Generator().manual_seed(batch))
        for model in built.values():
            decode_seconds(model, prompt, 8)  # warm-up
        times = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                times[name].append(decode_seconds(built[name], prompt, args.new_tokens))
        baseline = statistics.median(times[BASELINE])
        for name in names:
            median = statistics.median(times[name])
            results[f"{name}/batch{batch}"] = dict(seconds=median, ratio=median / baseline,
                                                   tokens_per_s=batch * args.new_tokens / median)  # fmt: skip
            print(f"batch {batch:<3} {name:<18} {batch * args.new_tokens / median:8.0f} tokens/s   "
                  f"{BASELINE} / this {median / baseline:5.2f}   {label}")  # fmt: skip
    if args.json:
        print(json.dumps(dict(machine=label, shape=args.shape, new_tokens=args.new_tokens, results=results)))


if __name__ == "__main__":
    main()
