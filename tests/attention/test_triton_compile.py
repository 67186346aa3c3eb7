"""The fused Triton kernels compile for NVIDIA GPUs in every configuration the dispatcher admits, checked on CPU.

The Triton interpreter that runs the kernels in the other tests accepts code a GPU compiler rejects (a
module-level Python float read inside a kernel, for one) and knows nothing of shared memory or registers.
Here the forward, dK/dV and dQ kernels (each a first pass and an exact pass) are compiled ahead of time
(tools/kernels/triton_aot.py: triton.compile for GPUTarget("cuda", arch, 32) and the ptxas of Triton's wheel) for
the architectures of the GPUs that run them (triton_configs.SHARED_MEMORY_LIMIT), for the dtypes and head sizes that
``triton_unsupported_reason`` admits there. Each must compile and its shared memory must fit the smallest limit among
the GPUs that run its table (triton_configs.FAMILY_TABLES: sm_120 runs the 8.x table within 99 KB; the sample also
spills at most 4 KB per thread); registers and spills are printed. Each launch is also analysed as torch.compile
sees it (``triton_aot.written_arguments``, torch's own analysis of the kernel for that target): the analysis must
succeed, and no tensor that the kernel writes may share memory (a storage) with another of its arguments, or the
clones that torch.compile's functionalization writes back would overwrite each other. Triton's cache points at a new
directory, so that nothing compiled before can hide a failure; the compilation starts with the first attention test
(conftest.py).

By default a sample (``SAMPLE``, 242 kernel passes): on sm_80 and sm_90 every padded head size each dtype is admitted
at, every kernel and pass of each dtype, each side of every branch (causal, a sliding window, key padding, packed
documents, euler, each class of the power, one p and two in a launch, lengths that are not multiples of 16, Nq < Nk,
a value size of its own, q, k and v tokens-major as a model's projections give them) and the configuration that failed
on an H200; the paper's two p in one launch of the exact
passes alone (small calls) on every architecture; on sm_100 (its own table) the first passes at every padded head size
of each dtype and every pass at head size 256; on sm_120 every pass at head size 256 and a few first passes; and the
launch configurations that benchmarks/gpu_check.py's kernels section measures beside the adopted ones at head size 256
on sm_90 (``CONFIG_VARIANTS``: the kernels each changes, under every branch with a window).
``-m kernels`` compiles the full matrix (``FULL_MATRIX``, about 11,200 kernels, one child process per core): every
head size from 16 to 256 with every branch on sm_80, sm_86, sm_87, sm_89, sm_90, sm_100, sm_103, sm_120 and sm_121;
at head sizes 64 and 128 on sm_80 and sm_90 every combination of the flags (causal ones with and without a sliding
window) with each p set; at head size 256 on sm_80, sm_90, sm_100 and sm_120, and at 64 and 128 on sm_100 and sm_120,
each flag alone, none and all, with each power class; the paper's mix in one launch of the exact passes alone at head
sizes 16 to 256 on every architecture.
``PLAT_AOT_TRITON=<folder>`` compiles with the Triton installed in that folder instead of this machine's
(tools/kernels/README.md).
"""

import itertools

import pytest
import torch

from modeling_plat import plap_attention_triton as triton_module
from modeling_plat import triton_configs
from modeling_plat.plap_attention_triton import launch_groups
from modeling_plat.triton_tiles import POWER_ANY, POWER_MINUS_QUARTER, POWER_QUARTER, POWER_QUARTERS
from gpu_sections.kernels import CONFIG_VARIANTS
from triton_aot import KERNELS, case_id, case_kernels, case_p

pytestmark = pytest.mark.skipif(triton_module.triton is None, reason="triton is not installed")

DTYPES = ("bfloat16", "float16", "float32")
SAMPLE_ARCHS = (80, 90)  # every property of the sample below on each; sm_100 and sm_120: blackwell_cases
# Every architecture whose GPUs run the kernels (triton_configs.SHARED_MEMORY_LIMIT), in the full matrix.
MATRIX_ARCHS = (80, 86, 87, 89, 90, 100, 103, 120, 121)
FIRST_PASSES = ("fwd", "dkdv", "dq")
EXACT_PASSES = ("fwd_exact", "dkdv_exact", "dq_exact")
FLAGS = ("is_causal", "key_mask", "euler", "documents")
ALL_ON, ALL_OFF = dict.fromkeys(FLAGS, True), dict.fromkeys(FLAGS, False)
CAUSAL = dict(ALL_OFF, is_causal=True)
# The power's classes (any p, p = 1.5, p = 2.5, and both of these in one launch where a call's exact pass runs alone),
# one compiled into each launch, whose heads take at most two p.
PAPER_MIX = [1.5, 2.5, 2.5]
OTHER_MIX = [2.5, 3.0, 3.0]
UNEVEN = (197, 250)  # Nq < Nk, neither a multiple of 16


def shared_memory_limit(arch):
    """The smallest opt-in shared memory among the GPUs that launch the table compiled for sm_<arch>
    (triton_configs.FAMILY_TABLES): the 8.x and 12.x GPUs share one (sm_86, sm_89, sm_120 and sm_121 have 99 KB,
    sm_80 163 KB)."""
    table = triton_configs.config_table((arch // 10, arch % 10))
    return min(limit for capability, limit in triton_configs.SHARED_MEMORY_LIMIT.items()
               if triton_configs.config_table(capability) == table)  # fmt: skip


def admitted(case):
    capability = (case["arch"] // 10, case["arch"] % 10)
    dtype = getattr(torch, case["dtype"])
    return triton_module.capability_reason(capability, dtype, case["head_dim"], case["value_dim"]) is None


def make_case(arch, dtype, head_dim, value_dim=None, flags=ALL_ON, p=1.5, lengths=(256, 256), kernels=KERNELS,
              window=0, alone=False, tokens_major=False):  # fmt: skip
    """A case of triton_aot; packed rows have as many queries as keys; ``window`` a causal sliding window's size;
    ``alone``: each kernel's exact pass alone (small calls), its ``EXACT_PASSES``."""
    num_queries, num_keys = lengths
    return dict(arch=arch, dtype=dtype, head_dim=head_dim, value_dim=value_dim or head_dim, **flags, p=p,
                num_queries=num_queries, num_keys=num_queries if flags["documents"] else num_keys,
                kernels=EXACT_PASSES if alone else kernels, window=window, alone=alone,
                tokens_major=tokens_major)  # fmt: skip


def sample_cases(arch):
    return [
        # The H200's failure with Triton 3.6 (PassManager::run failed in dQ's first pass on sm_90): the paper's mix
        # under causal masking alone, where the first passes run under their register cap.
        make_case(arch, "bfloat16", 64, flags=CAUSAL, p=PAPER_MIX, kernels=FIRST_PASSES),
        make_case(arch, "bfloat16", 128, flags=CAUSAL, p=PAPER_MIX, kernels=FIRST_PASSES),
        # The exact passes alone of a small call, the paper's two p in one launch: the paper LM's head size under
        # causal masking, and every branch.
        make_case(arch, "bfloat16", 16, flags=CAUSAL, p=PAPER_MIX, alone=True),
        make_case(arch, "bfloat16", 64, p=PAPER_MIX, alone=True),
        # q, k and v as a model's projections give them (tokens-major; row strides of H * d, the output's too): the
        # paper LM's small calls, and training's first passes and float32's head chunks.
        make_case(arch, "bfloat16", 16, flags=CAUSAL, p=PAPER_MIX, alone=True, tokens_major=True),
        make_case(arch, "bfloat16", 64, flags=CAUSAL, p=PAPER_MIX, kernels=FIRST_PASSES, tokens_major=True),
        make_case(arch, "float32", 128, 80, flags=ALL_OFF, lengths=UNEVEN, kernels=FIRST_PASSES, tokens_major=True),
        # As torch.compile's launcher types them (Python floats as float64): the kernels take their floats in float32.
        dict(make_case(arch, "bfloat16", 16, flags=CAUSAL, p=PAPER_MIX, kernels=FIRST_PASSES), float64_scalars=True),
        # Every pass of each kernel of each dtype, every branch taken: the most state, the most spills. One p a case:
        # the paper's two p are a launch each, compiled alike (spills within 50 bytes of each other).
        # A sliding window (Mistral's, Gemma's): its loop bounds and the window's edge in the masked tiles.
        make_case(arch, "bfloat16", 64, flags=dict(ALL_ON, euler=False), window=100),
        make_case(arch, "bfloat16", 128, p=2.5),
        make_case(arch, "float16", 64, p=OTHER_MIX),
        # float32 above 64, whose products over the head sizes load 32 columns at a time: a value size that ends in
        # part of a chunk.
        make_case(arch, "float32", 128, 80, p=OTHER_MIX),
        # The other side of every branch: no mask, paper, one p, uneven lengths.
        make_case(arch, "float32", 64, flags=ALL_OFF, lengths=UNEVEN),
        # The other padded head sizes of each dtype (first passes): sizes that are not powers of two, and a value
        # size of its own that decides the padding.
        make_case(arch, "bfloat16", 16, kernels=FIRST_PASSES),
        make_case(arch, "bfloat16", 16, 24, kernels=FIRST_PASSES),
        make_case(arch, "float16", 16, kernels=FIRST_PASSES),
        make_case(arch, "float16", 32, kernels=FIRST_PASSES),
        make_case(arch, "float16", 80, kernels=FIRST_PASSES),
        make_case(arch, "float32", 16, kernels=FIRST_PASSES),
        make_case(arch, "float32", 24, kernels=FIRST_PASSES),
        make_case(arch, "float32", 256, kernels=FIRST_PASSES),
        # Head size 256 (every branch), and a value size that alone pads to it.
        make_case(arch, "bfloat16", 256, kernels=FIRST_PASSES),
        make_case(arch, "float16", 128, 160, flags=ALL_OFF, lengths=UNEVEN, kernels=FIRST_PASSES),
    ]


def blackwell_cases():
    """sm_100 runs a table of its own: its first passes at every padded head size of each dtype, and every pass at head
    size 256 under every branch. sm_120 runs the 8.x table, compiled for its own instructions: the passes that hold the
    most (head size 256, every branch) and each dtype's largest bucket."""
    every_bucket = [(dtype, d) for dtype in ("bfloat16", "float16") for d in (16, 32, 64, 128)] + [
        ("float16", 256)] + [("float32", d) for d in (16, 32, 64, 128, 256)]  # fmt: skip
    return [
        make_case(100, "bfloat16", 256, flags=dict(ALL_ON, euler=False), window=100),
        *(make_case(100, dtype, d, flags=ALL_OFF, lengths=UNEVEN, kernels=FIRST_PASSES) for dtype, d in every_bucket),
        make_case(120, "bfloat16", 256, p=OTHER_MIX),
        *(make_case(arch, "bfloat16", 64, p=PAPER_MIX, alone=True) for arch in (100, 120)),
        make_case(120, "float16", 128, flags=CAUSAL, kernels=FIRST_PASSES),
        make_case(120, "float32", 256, kernels=FIRST_PASSES),
    ]


def variant_cases():
    """The launch configurations that benchmarks/gpu_check.py's kernels section measures beside the adopted ones at
    head size 256 on sm_90 (``CONFIG_VARIANTS``), under every branch with a window: the kernels each changes (split
    changes only wide's dK/dV)."""
    adopted = triton_module.launch_config(torch.bfloat16, 256, 256, (9, 0))
    changed = {"wide": KERNELS, "split": ("dkdv", "dkdv_exact")}
    return [dict(make_case(90, "bfloat16", 256, flags=dict(ALL_ON, euler=False), p=PAPER_MIX, kernels=kernels,
                           window=100),
                 variant=variant, config=[list(fields) for fields in CONFIG_VARIANTS[variant][1](adopted)])
            for variant, kernels in changed.items()]  # fmt: skip


SAMPLE = [case for arch in SAMPLE_ARCHS for case in sample_cases(arch)] + blackwell_cases() + variant_cases()


def full_matrix():
    head_sizes = [(d, d) for d in (16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256)] + [(16, 24), (64, 80), (128, 64),
                                                                                         (128, 160), (256, 96)]  # fmt: skip
    flag_sets = [dict(zip(FLAGS, values)) for values in itertools.product((False, True), repeat=len(FLAGS))]
    every_size = [make_case(arch, dtype, d, dv, lengths=UNEVEN)
                  for arch, dtype, (d, dv) in itertools.product(MATRIX_ARCHS, DTYPES, head_sizes)]  # fmt: skip
    every_branch = [make_case(arch, dtype, d, flags=flags, p=p, lengths=UNEVEN, window=window)
                    for arch, dtype, d, flags, p, window in itertools.product(
                        SAMPLE_ARCHS, DTYPES, (64, 128), flag_sets, (1.5, PAPER_MIX, OTHER_MIX), (0, 100))
                    if flags["is_causal"] or not window]  # fmt: skip
    # Head size 256 everywhere, and the Blackwell architectures: each branch alone, none and all, each p class.
    each_flag = [ALL_OFF, ALL_ON] + [dict(ALL_OFF, **{flag: True}) for flag in FLAGS]
    each_branch = [make_case(arch, dtype, d, flags=flags, p=p, lengths=UNEVEN, window=window)
                   for arch, dtype, d, flags, p, window in itertools.product(
                       (80, 90, 100, 120), DTYPES, (64, 128, 256), each_flag, (PAPER_MIX, OTHER_MIX), (0, 100))
                   if (flags["is_causal"] or not window) and (d == 256 or arch >= 100)]  # fmt: skip
    every_branch_8x = [make_case(arch, dtype, 64, flags=flags, lengths=UNEVEN)
                       for arch, dtype, flags in itertools.product((86, 89), DTYPES, flag_sets)]  # fmt: skip
    # The paper's mix in one launch (the exact passes alone of small calls): every branch, and causal with a window.
    merged = [make_case(arch, dtype, d, flags=flags, p=PAPER_MIX, lengths=UNEVEN, window=window, alone=True)
              for arch, dtype, d, (flags, window) in itertools.product(
                  MATRIX_ARCHS, DTYPES, (16, 64, 128, 256), ((ALL_ON, 0), (CAUSAL, 100)))]  # fmt: skip
    cases = every_size + every_branch + each_branch + every_branch_8x + merged
    unique = {case_id(case): case for case in cases if admitted(case)}
    return list(unique.values())


FULL_MATRIX = full_matrix()


def reported(compilation, pytestconfig):
    """{(case id, kernel): result} of a Compilation (conftest.py), each printed."""
    results = compilation.results()
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\nTriton {results[0]['triton']}")
        for r in results:
            usage = (f"shared {r['shared']:>6} / {shared_memory_limit(r['arch'])}  registers {r['registers']}  "
                     f"spills {r['spill_stores']}/{r['spill_loads']} B" if r["ok"] else "FAILED")  # fmt: skip
            print(f"{r['case']:<58} {r['kernel']:<10} {usage}  {r['seconds']:.1f} s")
    return {(r["case"], r["kernel"]): r for r in results}


@pytest.fixture(scope="module")
def sample_results(sample_compilation, pytestconfig):
    return reported(sample_compilation, pytestconfig)


@pytest.fixture(scope="module")
def full_results(full_compilation, pytestconfig):
    return reported(full_compilation, pytestconfig)


# Spill stores per thread of any sampled kernel. A tile that ptxas cannot allocate falls back to a few registers and
# kilobytes of local memory (sm_80 dK/dV at 16 x 128 with two p in one launch: 32 registers, 11-13 KB); today's largest
# are the exact passes under every branch at head size 128 on sm_90, 2.1 KB.
MAX_SPILL_BYTES = 4096


def check(result, arch, max_spill=None):
    assert result["ok"], result["error"] + "\n" + result["trace"]
    assert result["shared"] <= shared_memory_limit(arch), f"{result['shared']} bytes of shared memory"
    if max_spill is not None:
        assert result["spill_stores"] <= max_spill, f"{result['spill_stores']} bytes of spills per thread"
    for launch in result["launches"]:  # torch.compile's view of each launch (triton_aot.written_arguments)
        assert launch["written"] is not None, "torch's analysis of the kernel failed: it takes every tensor as written"
        assert {"Out", "GradQ", "GradK"} & set(launch["written"]), launch["written"]
        assert not launch["overlaps"], f"written arguments share memory with others: {launch['overlaps']}"


def case_kernel_params(cases):
    return [pytest.param(case, kernel, id=f"{case_id(case)}-{kernel}") for case in cases for kernel in case_kernels(case)]


@pytest.mark.parametrize("case, kernel", case_kernel_params(SAMPLE))
def test_kernel_compiles_and_fits(sample_results, case, kernel):
    check(sample_results[case_id(case), kernel], case["arch"], MAX_SPILL_BYTES)


@pytest.mark.kernels
@pytest.mark.parametrize("case, kernel", case_kernel_params(FULL_MATRIX))
def test_kernel_compiles_and_fits_everywhere(full_results, case, kernel):
    check(full_results[case_id(case), kernel], case["arch"])


def sampled(arch, dtype):
    return [case for case in SAMPLE if case["arch"] == arch and case["dtype"] == dtype]


@pytest.mark.parametrize("arch, dtype", list(itertools.product(SAMPLE_ARCHS, DTYPES)))
def test_sample_compiles_every_admitted_head_size(arch, dtype):
    """Launch configurations are per input kind and padded head size (BLOCK_D), and each dtype compiles its own code:
    every bucket that the dtype admits on the architecture has its first passes in the sample, so that no admitted
    input runs a configuration compiled nowhere (test_triton_limits.py checks the dispatcher against the sample)."""
    buckets = {triton_module.padded_head_size(d) for d in range(1, 513)
               if admitted(dict(arch=arch, dtype=dtype, head_dim=d, value_dim=d))}  # fmt: skip
    compiled = {triton_module.padded_head_size(max(case["head_dim"], case["value_dim"]))
                for case in sampled(arch, dtype) if set(FIRST_PASSES) <= set(case_kernels(case))}  # fmt: skip
    assert compiled == buckets
    assert all(admitted(case) for case in sampled(arch, dtype))


@pytest.mark.parametrize("arch, dtype", list(itertools.product(SAMPLE_ARCHS, DTYPES)))
def test_sample_compiles_every_pass_of_each_dtype(arch, dtype):
    assert {kernel for case in sampled(arch, dtype) for kernel in case_kernels(case)} == set(KERNELS)


@pytest.mark.parametrize("arch", SAMPLE_ARCHS)
def test_sample_takes_each_side_of_every_branch(arch):
    cases = [case for case in SAMPLE if case["arch"] == arch]
    for flag in FLAGS:
        assert {case[flag] for case in cases} == {False, True}, flag
    classes = {launch[2] for case in cases for launch in launch_groups(case_p(case), case["alone"])}
    assert classes == {int(power) for power in (POWER_ANY, POWER_MINUS_QUARTER, POWER_QUARTER, POWER_QUARTERS)}
    assert {len(set(case_p(case))) for case in cases} == {1, 2}
    assert {bool(case["window"]) for case in cases} == {False, True}
    assert {case["num_queries"] % 16 == 0 for case in cases} == {False, True}
    assert any(case["num_queries"] < case["num_keys"] for case in cases)
    assert any(case["head_dim"] != case["value_dim"] for case in cases)
