"""attn_implementation="plap" against PlatForCausalLM: the same p-LaT model, trained and decoded two ways.

The plat-llama-tiny sizes (4 layers x 128, 8 query heads over 4 key/value heads, rotary positions, RMSNorm, SwiGLU
352, 10k vocabulary, p = 4 x 1.5 + 4 x 2.5) as transformers' LlamaForCausalLM with attn_implementation="plap" and as
PlatForCausalLM with the same weights (convert_to_plat). A training step (AdamW, --batch x --length tokens) and
greedy decoding with the KV cache (16-token prompt, --new_tokens tokens, batch 1 and 8). Each repeat runs both
models once in alternating order; the printed ratio is the interface's median time over PlatForCausalLM's, beside
the machine it was measured on.

    python benchmarks/bench_attention_interface.py --repeats 9
"""

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_plat  # noqa: F401  (registers attn_implementation="plap")
from machine import facts_label, machine_facts
from modeling_plat import paper_p_mix
from modeling_plat.convert import convert_to_plat

SIZES = dict(vocab_size=10000, hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=352, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
             bos_token_id=0, eos_token_id=0)  # fmt: skip


def models():
    """{name: model}: the interface's LlamaForCausalLM and PlatForCausalLM with its weights, both the paper's mix."""
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES)
    config.plap_p = paper_p_mix(config.num_attention_heads)
    interface = LlamaForCausalLM._from_config(config, attn_implementation="plap")
    return {"interface": interface, "PlatForCausalLM": convert_to_plat(interface, plap_p=config.plap_p)}


def train_step_seconds(model, batch, length):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, SIZES["vocab_size"], (batch, length))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: allocations, first-call dispatch
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def decode_seconds(model, batch, new_tokens):
    model.eval()
    ids = torch.randint(1, SIZES["vocab_size"], (batch, 16))
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(ids, **options, max_length=None)
    start = time.perf_counter()
    model.generate(ids, **options, max_length=None)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=32)
    args = parser.parse_args()
    facts = machine_facts(torch.device("cpu"))
    built = models()
    measures = {
        f"train step {args.batch} x {args.length}": lambda m: train_step_seconds(m, args.batch, args.length),
        **{f"decode batch {b}, {args.new_tokens} tokens": (lambda m, b=b: decode_seconds(m, b, args.new_tokens))
           for b in (1, 8)},
    }
    results = {}
    for label, measure in measures.items():
        times = {name: [] for name in built}
        for repeat in range(args.repeats):
            order = list(built) if repeat % 2 == 0 else list(reversed(built))
            for name in order:
                times[name].append(measure(built[name]))
        medians = {name: statistics.median(values) for name, values in times.items()}
        ratio = medians["interface"] / medians["PlatForCausalLM"]
        results[label] = {**medians, "ratio": ratio}
        print(f"{label}: interface {medians['interface'] * 1e3:.1f} ms, PlatForCausalLM "
              f"{medians['PlatForCausalLM'] * 1e3:.1f} ms, ratio {ratio:.3f} ({facts_label(facts)})", flush=True)
    print(json.dumps({"machine": facts, "results": results}))


if __name__ == "__main__":
    main()
