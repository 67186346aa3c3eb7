"""A static cost model of the fused Triton kernels on NVIDIA GPUs, computed on a machine without one.

    python tools/kernels/gpu_static_cost.py [--quick] [--unfused] [--json results.json]

Each kernel (forward, dK/dV, dQ) is compiled for sm_90 (H100) and sm_80 (A100) with the launch configuration
that the Triton backend uses there (tools/kernels/triton_aot.py: Triton's compiler and the ptxas of its wheel), then
disassembled with the wheel's ``cuobjdump -sass``. The main loop is the range of a backward branch, the
shortest that holds a matmul (the loop of plain tiles where a kernel splits off the masked ones). Its
instructions are counted per score, that is divided by the scores one thread handles per iteration
(BLOCK_M * BLOCK_N / (32 * num_warps)), so that tiles that repeat work across warps count it, on the common path:
without the block its largest forward branch jumps over, the direct differences of a tile with close pairs of
values (``rare`` in the table: what such a tile adds per score). ``spill`` counts ptxas' spill stores of the whole
kernel, ``loop`` the spill instructions inside the main loop (a reload of a value spilled before the loop costs an
issue slot and an L1 hit; a spill store inside it, a round trip per iteration).

Estimated time per score (clocks of one SM) = the slowest of the pipes below, each at its published per-SM
throughput (NVIDIA's H100 and A100 whitepapers: 4 schedulers, 16 SFUs, 128 / 64 FP32 lanes per SM; dense
bf16/fp16 tensor rate 989 TFLOP/s over 132 SMs at 1.83 GHz, 312 TFLOP/s over 108 SMs at 1.41 GHz):

- issue: 4 warp-instructions per clock (every instruction of the loop);
- MUFU (special functions: EX2, LG2, RSQ, RCP, SQRT, ...): 16 per clock;
- FP32 (FADD, FMUL, FFMA, FMNMX, FSETP, FSEL, ...): 128 per clock (sm_90), 64 (sm_80);
- tensor cores: 4096 (sm_90) / 2048 (sm_80) bf16 or fp16 FLOP per clock, TF32 at half that rate.

Memory (L2, shared-memory bandwidth) and latency are not modelled: the figure is a floor set by the
instructions each score needs, meant for comparing kernels compiled the same way. The yardstick is a
softmax-only FlashAttention-2-style forward (tools/kernels/flash_baseline_kernel.py) compiled for the same
architecture, dtype and head size; its backward is counted as 2.5 forwards. "paper mix" is the paper's heads:
half with p = 1.5, half with p = 2.5 (the time per score is their mean).

``--unfused`` compiles the p-LaT kernels once more without floating-point fusion (``enable_fp_fusion=False``), as
torch.compile's launches compile them where Triton's default is off (announced for Triton 3.10: Inductor passes user
kernels no fusion option), and prints their main loops' instructions per score beside (``unfused``): the kernels write
their loops' multiply-adds as FMAs (``tl.fma``), so that the two counts should be equal.

Needs Triton with its NVIDIA backend; TRITON_INTERPRET must not be set. A full sweep takes a few minutes.
"""

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas' registers, spills and warnings, read by the compile log
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="gpu-static-cost-"))  # a cache hit has no log

import torch

# Per-SM throughputs per clock, as in the module docstring.
THROUGHPUT = {
    90: dict(gpu="H100", issue=4, mufu=16, fp32=128, tensor=4096),
    80: dict(gpu="A100", issue=4, mufu=16, fp32=64, tensor=2048),
}
FP32_OPS = {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FSWZADD"}
CONVERSIONS = {"F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND"}
SHARED_OPS = {"LDS", "STS", "LDSM", "STSM", "LDGSTS"}
PAPER_MIX = (1.5, 2.5)
KERNEL_ORDER = ("fwd", "dkdv", "dq", "baseline")
# A branch's target, after the uniform predicate that sm_100 and sm_120 code names as an operand (BRA.U UP0, 0x...).
BRANCH_TARGET = re.compile(r"\s*(?:!?U?P\w+,\s*)?(?:`\()?(0x[0-9a-f]+)")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)\s*([^;]*);")


def cuobjdump():
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def disassemble(cubin):
    """[(address, opcode, modifiers, operands)] of the cubin's one kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        sass = subprocess.run([cuobjdump(), "-sass", handle.name], check=True, capture_output=True, text=True)
    return [(int(m[1], 16), m[3], m[4], m[5]) for m in INSTRUCTION.finditer(sass.stdout)]


def is_matmul(opcode):
    """Tensor-core instructions: mma.sync (HMMA), wgmma (HGMMA) and sm_100's tcgen05 (UTCHMMA and kin)."""
    return opcode in ("HGMMA", "HMMA") or (opcode.startswith("UTC") and opcode.endswith("MMA"))


def main_loop(instructions):
    """The instructions of the main loop: the shortest range from a backward branch's target to the branch that
    holds a matmul. Kernels may split their loop in two, tiles that need masks (diagonal, padding, the last
    partial tile) and plain tiles, the many; the plain loop is the shorter."""
    loops = []
    for address, opcode, _, operands in instructions:
        target = BRANCH_TARGET.match(operands)
        if opcode == "BRA" and target and int(target.group(1), 16) < address:
            body = [ins for ins in instructions if int(target.group(1), 16) <= ins[0] <= address]
            if any(is_matmul(ins[1]) for ins in body):
                loops.append(body)
    if not loops:
        raise ValueError("no loop with a matmul in the kernel")
    return min(loops, key=len)


def common_path(loop):
    """The main loop without the largest block that a forward branch inside it jumps over: the kernels' rare case
    (a tile with close pairs of values recomputes its distances by direct differences), which a tile without such
    pairs, the common one, skips."""
    end = loop[-1][0]
    skipped = (0, 0)
    for address, opcode, _, operands in loop:
        target = BRANCH_TARGET.match(operands)
        if opcode == "BRA" and target and address < int(target.group(1), 16) <= end:
            skipped = max(skipped, (address, int(target.group(1), 16)), key=lambda span: span[1] - span[0])
    return [ins for ins in loop if not skipped[0] < ins[0] < skipped[1]]


def mma_flops(opcode, modifiers):
    """(FLOP of one warp's instruction, cost factor: 2 for TF32, whose tensor rate is half of bf16's)."""
    factor = 2 if ".TF32" in modifiers else 1
    if opcode == "HGMMA":  # a warpgroup's m64 x n x k product, issued by each of its 4 warps
        m, n, k = map(int, re.match(r"\.(\d+)x(\d+)x(\d+)", modifiers).groups())
        return 2 * m * n * k / 4, factor
    shape = re.match(r"\.(\d+)", modifiers).group(1)  # HMMA.16816: m16 n8 k16; HMMA.1688: m16 n8 k8
    m, n, k = int(shape[:2]), int(shape[2]), int(shape[3:])
    return 2 * m * n * k, factor


def count_loop(loop, scores_per_thread):
    """Per-score counts of one main loop (instructions per thread, divided by its scores per iteration)."""
    counts = collections.Counter()
    mufu = collections.Counter()
    flops = 0.0
    for _, opcode, modifiers, _ in loop:
        if opcode == "NOP":
            continue
        counts["instructions"] += 1
        if opcode in ("HGMMA", "HMMA"):
            counts["mma"] += 1
            flop, factor = mma_flops(opcode, modifiers)
            flops += flop * factor
        elif opcode == "MUFU":
            mufu[modifiers.split(".")[1]] += 1
        elif opcode in FP32_OPS:
            counts["fp32"] += 1
        elif opcode in CONVERSIONS:
            counts["conversions"] += 1
        elif opcode in SHARED_OPS:
            counts["shared_ops"] += 1
    per_score = {name: counts[name] / scores_per_thread for name in
                 ("instructions", "mma", "fp32", "conversions", "shared_ops")}  # fmt: skip
    per_score["mufu"] = sum(mufu.values()) / scores_per_thread
    per_score["mufu_by_function"] = {name: n / scores_per_thread for name, n in sorted(mufu.items())}
    # FLOP of one warp's instruction; a warp's iteration covers 32 * scores_per_thread scores.
    per_score["tensor_flop"] = flops / (32 * scores_per_thread)
    return per_score


def clocks_per_score(per_score, arch):
    """Estimated SM clocks per score on each pipe, and the slowest."""
    rates = THROUGHPUT[arch]
    pipes = dict(
        issue=per_score["instructions"] / 32 / rates["issue"],
        mufu=per_score["mufu"] / rates["mufu"],
        fp32=per_score["fp32"] / rates["fp32"],
        tensor=per_score["tensor_flop"] / rates["tensor"],
    )
    bound = max(pipes, key=pipes.get)
    return dict(pipes, bound=bound, clocks=pipes[bound])


def analyse(launch, arch):
    """Everything the tool reports about one compiled kernel."""
    from triton_aot import compile_with_log, ptxas_usage

    compiled, log = compile_with_log(launch, arch)
    meta = launch.meta
    scores_per_thread = meta["BLOCK_M"] * meta["BLOCK_N"] / (32 * meta["num_warps"])
    instructions = disassemble(compiled.asm["cubin"])
    loop = main_loop(instructions)
    per_score = count_loop(common_path(loop), scores_per_thread)
    # Instructions per score that a tile taking the rare branch adds, and spills inside the loop (those elsewhere
    # run once per program).
    per_score["rare_branch"] = count_loop(loop, scores_per_thread)["instructions"] - per_score["instructions"]
    opcodes = {opcode for _, opcode, _, _ in instructions}
    loop_spills = sum(opcode in ("STL", "LDL") for _, opcode, _, _ in loop)
    return dict(
        per_score=per_score,
        loop_spills=loop_spills,
        loop_spill_stores=sum(opcode == "STL" for _, opcode, _, _ in loop),
        loop_spill_share=loop_spills / len(loop),
        **(clocks_per_score(per_score, arch) if arch in THROUGHPUT else {}),  # rates known for sm_80 and sm_90 only
        **ptxas_usage(log),
        shared=compiled.metadata.shared,
        mma_kind=("wgmma" if "HGMMA" in opcodes else "mma.sync" if "HMMA" in opcodes
                  else "tcgen05" if any(map(is_matmul, opcodes)) else "none"),  # fmt: skip
        warnings=sorted(set(re.findall(r"warning : .*?(C\d{4})", log))),
        config=dict(block_m=meta["BLOCK_M"], block_n=meta["BLOCK_N"], num_warps=meta["num_warps"],
                    num_stages=meta["num_stages"]),  # fmt: skip
    )


def baseline_config(triton_module, dtype, head_dim):
    """FlashAttention-2's usual forward tiles: 128 x 64, 4 warps (8 at head size 128)."""
    return triton_module.KernelConfig(128, 64, 4 if head_dim <= 64 else 8, 2)


def plat_launches(triton_module, case, p):
    """{kernel name: Launch} of the p-Laplacian kernels' first passes for one head with this p."""
    from triton_aot import launches

    return {name: launch for name, launch in launches(triton_module, dict(case, p=p)) if name in KERNEL_ORDER}


def analyse_once(launch, arch, cache):
    """``analyse`` once per kernel and compile-time arguments (``cache`` a dict): launches that differ in their other
    arguments only (heads of other p of one power class) share a compiled kernel, which Triton's cache would hand back
    without a compile log."""
    key = (launch.kernel.__name__, arch, tuple(sorted(launch.meta.items())))
    if key not in cache:
        cache[key] = analyse(launch, arch)
    return cache[key]


def without_fusion(launch):
    """The launch compiled without floating-point fusion: each multiply and add rounded apart, as written."""
    return launch._replace(meta=dict(launch.meta, enable_fp_fusion=False))


def run_case(case, cache, unfused=False):
    """The kernels of one case: per kernel its analysis, averaged over the paper mix for the plat kernels, and where
    ``unfused`` the instructions per score of the plat kernels compiled ``without_fusion`` (``unfused``)."""
    from flash_baseline_kernel import baseline_launch

    from modeling_plat import plap_attention_triton as triton_module

    def memo(launch):
        return analyse_once(launch, case["arch"], cache)

    kernels, unfused_counts = collections.defaultdict(list), collections.defaultdict(list)
    for p in PAPER_MIX:
        for name, launch in plat_launches(triton_module, case, p).items():
            kernels[name].append(memo(launch))
            if unfused:
                unfused_counts[name].append(memo(without_fusion(launch))["per_score"]["instructions"])
    dtype = getattr(torch, case["dtype"])
    query = torch.zeros(2, 3, case["num_queries"], case["head_dim"], dtype=dtype)
    config = baseline_config(triton_module, dtype, case["head_dim"])
    stats = torch.zeros(2, 3, case["num_queries"])
    launch = baseline_launch(query, torch.zeros_like(query), stats, case["is_causal"], config, triton_module.Launch)
    result = {name: mix(analyses) for name, analyses in kernels.items()}
    for name, counts in unfused_counts.items():
        result[name] = dict(result[name], unfused=sum(counts) / len(counts))
    result["baseline"] = memo(launch)
    base = result["baseline"]["clocks"]
    result["ratios"] = dict(
        fwd=result["fwd"]["clocks"] / base,
        fwd_bwd=sum(result[name]["clocks"] for name in ("fwd", "dkdv", "dq")) / (3.5 * base),
    )
    return result


def mix(analyses):
    """The mean per-score cost of the kernels of the p classes (equal numbers of heads); the worst resources."""
    if len(analyses) == 1 or all(a == analyses[0] for a in analyses):
        return analyses[0]
    merged = dict(analyses[0])
    merged["per_score"] = {
        name: (
            {fn: sum(a[name].get(fn, 0) for a in map(lambda a: a["per_score"], analyses)) / len(analyses)
             for fn in set().union(*(a["per_score"][name] for a in analyses))}  # fmt: skip
            if name == "mufu_by_function"
            else sum(a["per_score"][name] for a in analyses) / len(analyses)
        )
        for name in analyses[0]["per_score"]
    }
    for pipe in ("issue", "mufu", "fp32", "tensor", "clocks"):
        merged[pipe] = sum(a[pipe] for a in analyses) / len(analyses)
    merged["bound"] = "/".join(sorted({a["bound"] for a in analyses}))
    for name in ("registers", "spill_stores", "spill_loads", "loop_spills", "loop_spill_stores", "loop_spill_share",
                 "shared"):
        merged[name] = max(a[name] or 0 for a in analyses)
    merged["warnings"] = sorted(set().union(*(a["warnings"] for a in analyses)))
    return merged


def sweep(quick):
    """The cases: sm_90 and sm_80, bf16 and fp16, head sizes 64 and 128, causal or not, paper or euler;
    ``quick``: sm_90, bf16, 64, not causal, paper."""
    archs, dtypes, head_dims, causal, euler = (
        ((90,), ("bfloat16",), (64,), (False,), (False,))
        if quick
        else ((90, 80), ("bfloat16", "float16"), (64, 128), (False, True), (False, True))
    )
    return [
        dict(arch=arch, dtype=dtype, head_dim=d, value_dim=d, is_causal=c, key_mask=False, euler=e,
             num_queries=1024, num_keys=1024)  # fmt: skip
        for arch, dtype, d, c, e in itertools.product(archs, dtypes, head_dims, causal, euler)
    ]


def case_name(case):
    flags = ("causal " if case["is_causal"] else "") + ("euler" if case["euler"] else "paper")
    return f"sm_{case['arch']} {case['dtype']} d={case['head_dim']} {flags}"


def table(records):
    """The terminal table: one row per kernel of each case."""
    header = (f"{'case':<34} {'kernel':<8} {'instr':>6} {'mma':>5} {'mufu':>5} {'mufu by function':<26} "
              f"{'fp32':>5} {'conv':>5} {'smem':>5} {'regs':>4} {'spill':>5} {'loop':>4} {'shared':>6} {'mma kind':<8} "
              f"{'warn':<5} {'bound':<6} {'clk':>6} {'x base':>6} {'rare':>6} {'unfused':>7}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for record in records:
        result = record["result"]
        base = result["baseline"]["clocks"]
        for name in KERNEL_ORDER:
            a = result[name]
            s = a["per_score"]
            functions = " ".join(f"{fn}:{n:.2f}" for fn, n in s["mufu_by_function"].items())
            lines.append(
                f"{record['name']:<34} {name:<8} {s['instructions']:>6.1f} {s['mma']:>5.2f} {s['mufu']:>5.2f} "
                f"{functions:<26} {s['fp32']:>5.1f} {s['conversions']:>5.2f} {s['shared_ops']:>5.2f} "
                f"{a['registers'] or 0:>4} {a['spill_stores'] or 0:>5} {a['loop_spills']:>4} {a['shared']:>6} "
                f"{a['mma_kind']:<8} {','.join(a['warnings']) or '-':<5} {a['bound']:<6} {a['clocks']:>6.3f} "
                f"{a['clocks'] / base:>6.2f} {s['rare_branch']:>6.1f} "
                f"{format(a['unfused'], '7.1f') if 'unfused' in a else '-':>7}"
            )
        ratios = result["ratios"]
        lines.append(f"{record['name']:<34} estimated time / baseline: forward {ratios['fwd']:.2f}x, "
                     f"forward + backward {ratios['fwd_bwd']:.2f}x")  # fmt: skip
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sm_90, bfloat16, head size 64, not causal, paper")
    parser.add_argument("--unfused", action="store_true",
                        help="also count the p-LaT kernels compiled without floating-point fusion")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("TRITON_INTERPRET is set: the kernels are interpreted functions and cannot be compiled")
    cache = {}
    records = [dict(name=case_name(case), case=case, result=run_case(case, cache, args.unfused))
               for case in sweep(args.quick)]  # fmt: skip
    print("Static estimate (instructions per score of each kernel's main loop; clk = estimated SM clocks per score)")
    print("throughputs per SM and clock:", json.dumps(THROUGHPUT))
    print(table(records))
    if args.json:
        args.json.write_text(json.dumps(dict(throughput=THROUGHPUT, records=records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
