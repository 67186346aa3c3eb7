"""The fused Triton kernels compile for NVIDIA GPUs in every configuration the dispatcher admits, checked on CPU.

The Triton interpreter that runs the kernels in the other tests accepts code a GPU compiler rejects (a
module-level Python float read inside a kernel, for one) and knows nothing of shared memory or registers.
Here the forward, dK/dV and dQ kernels (each a first pass and an exact pass) are compiled ahead of time
(tools/kernels/triton_aot.py: triton.compile for GPUTarget("cuda", arch, 32) and the ptxas of Triton's wheel) for sm_80
(A100, and the configurations that the other 8.x GPUs share) and sm_90 (H100), for each dtype and head size that
``triton_unsupported_reason`` admits there. Each must compile and its shared memory must fit the smallest limit among the GPUs that use its
configuration (the default cases also spill at most 4 KB per thread); registers and spills are printed.

Compiled: every admitted (arch, dtype, head size) with causal + key padding + euler + packed documents (every
optional branch of the kernels, and the most state; packed rows have as many queries as keys), at head sizes 16, 32, 64, 128 (one per padded size) and 80 (not a power of
two, padded to 128) and one with a value size that differs; and per (arch, dtype) the other side of each
branch (no mask, paper) at head size 64 with lengths that are not multiples of 16 and Nq < Nk. ``-m slow``
compiles more head sizes, every flag combination at head size 64, and sm_86 / sm_89 as well. Triton's cache
points at a new directory, so that nothing compiled before can hide a failure.
"""

import itertools

import pytest
import torch

from modeling_plat import plap_attention_triton as triton_module
from triton_aot import case_id, case_kernels, run_cases

pytestmark = pytest.mark.skipif(triton_module.triton is None, reason="triton is not installed")

DTYPES = ("bfloat16", "float16", "float32")


def shared_memory_limit(arch):
    """The smallest opt-in shared memory among the GPUs that launch what is compiled for sm_<arch>: the 8.x
    GPUs share one configuration table (sm_86 and sm_89 have 99 KB, sm_80 163 KB)."""
    family = [cap for cap in triton_module.SHARED_MEMORY_LIMIT if cap[0] == arch // 10]
    return min(triton_module.SHARED_MEMORY_LIMIT[cap] for cap in family)


def admitted(arch, dtype, head_dim, value_dim):
    capability = (arch // 10, arch % 10)
    return triton_module.capability_reason(capability, getattr(torch, dtype), head_dim, value_dim) is None


def make_case(arch, dtype, head_dim, value_dim, flags, lengths, p):
    is_causal, key_mask, euler, documents = flags
    return dict(arch=arch, dtype=dtype, head_dim=head_dim, value_dim=value_dim, is_causal=is_causal,
                key_mask=key_mask, euler=euler, documents=documents, num_queries=lengths[0],
                num_keys=lengths[1] if not documents else lengths[0], p=p)  # fmt: skip


def cases(archs, head_dims, flag_sets, lengths=(256, 256), p=1.5):
    return [
        make_case(arch, dtype, head_dim, value_dim, flags, lengths, p)
        for arch, dtype, (head_dim, value_dim), flags in itertools.product(archs, DTYPES, head_dims, flag_sets)
        if admitted(arch, dtype, head_dim, value_dim)
    ]


ALL_ON, ALL_OFF = (True,) * 4, (False,) * 4
# The power's classes (p = 1.5, 2.5 and any other p) compile different code, and a launch whose heads have two p
# compiles the code of both: the paper's mix at head sizes 64 and 128, and 2.5 beside another p at 128.
# Each kernel's exact pass is its first pass plus the close pairs' loop: by default compiled for the head sizes whose
# blocks no other case compiles with it (64 and 128, and 64 beside a value size of 80), with -m slow everywhere.
FIRST_PASSES = ("fwd", "dkdv", "dq")
DEFAULT_CASES = (
    [dict(case, kernels=FIRST_PASSES) for case in cases((80, 90), [(16, 16), (32, 32), (80, 80)], [ALL_ON])]
    + cases((80, 90), [(64, 80)], [ALL_ON])
    + cases((80, 90), [(64, 64), (128, 128)], [ALL_ON], p=[1.5, 2.5, 2.5])
    + cases((80, 90), [(64, 64)], [ALL_OFF], lengths=(197, 250))
    + cases((80, 90), [(128, 128)], [ALL_ON], p=[2.5, 3.0, 3.0])
)
SLOW_ARCHS = (80, 86, 89, 90)
SLOW_CASES = cases(
    SLOW_ARCHS, [(d, d) for d in (16, 24, 32, 48, 64, 80, 96, 128)] + [(16, 24), (128, 64)], [ALL_ON], (197, 250)
) + cases(SLOW_ARCHS, [(64, 64)], [f for f in itertools.product((False, True), repeat=4) if f != ALL_ON], (197, 250))


def compile_all(cases, tmp_path_factory, pytestconfig):
    results = run_cases(cases, tmp_path_factory.mktemp("triton-cache"))
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print()
        for r in results:
            usage = (f"shared {r['shared']:>6} / {shared_memory_limit(r['arch'])}  registers {r['registers']}  "
                     f"spills {r['spill_stores']}/{r['spill_loads']} B" if r["ok"] else "FAILED")  # fmt: skip
            print(f"{r['case']:<58} {r['kernel']:<5} {usage}  {r['seconds']:.1f} s")
    return {(r["case"], r["kernel"]): r for r in results}


def selected_cases(request, test_name):
    """The cases of the selected tests of that name (all of them, or fewer with -k), each once."""
    cases = {}
    for item in request.session.items:
        if getattr(item, "originalname", None) == test_name:
            case = item.callspec.params["case"]
            cases[case_id(case)] = case
    return list(cases.values())


@pytest.fixture(scope="module")
def default_results(request, tmp_path_factory, pytestconfig):
    cases = selected_cases(request, "test_kernel_compiles_and_fits")
    return compile_all(cases, tmp_path_factory, pytestconfig)


@pytest.fixture(scope="module")
def slow_results(request, tmp_path_factory, pytestconfig):
    cases = selected_cases(request, "test_kernel_compiles_and_fits_everywhere")
    return compile_all(cases, tmp_path_factory, pytestconfig)


# Spill stores per thread of any default case. A tile that ptxas cannot allocate falls back to a few registers and
# kilobytes of local memory (sm_80 dK/dV at 16 x 128 with two p in one launch: 32 registers, 11-13 KB); today's largest
# are the exact passes under every branch at head size 128 on sm_90, 2.1 KB.
MAX_SPILL_BYTES = 4096


def check(result, arch, max_spill=None):
    assert result["ok"], result["error"] + "\n" + result["trace"]
    assert result["shared"] <= shared_memory_limit(arch), f"{result['shared']} bytes of shared memory"
    if max_spill is not None:
        assert result["spill_stores"] <= max_spill, f"{result['spill_stores']} bytes of spills per thread"


def case_kernel_params(cases):
    return [pytest.param(case, kernel, id=f"{case_id(case)}-{kernel}") for case in cases for kernel in case_kernels(case)]


@pytest.mark.parametrize("case, kernel", case_kernel_params(DEFAULT_CASES))
def test_kernel_compiles_and_fits(default_results, case, kernel):
    check(default_results[case_id(case), kernel], case["arch"], MAX_SPILL_BYTES)


@pytest.mark.slow
@pytest.mark.parametrize("case, kernel", case_kernel_params(SLOW_CASES))
def test_kernel_compiles_and_fits_everywhere(slow_results, case, kernel):
    check(slow_results[case_id(case), kernel], case["arch"])


def test_every_admitted_head_size_is_compiled():
    """Kernels compile per padded head size (BLOCK_D): every bucket that some dtype admits on sm_80 or sm_90
    is among the default cases, so that no admitted input runs a configuration compiled nowhere."""
    for arch, dtype in itertools.product((80, 90), DTYPES):
        buckets = {triton_module.padded_head_size(d) for d in range(1, 513) if admitted(arch, dtype, d, d)}
        compiled = {triton_module.padded_head_size(c["head_dim"]) for c in DEFAULT_CASES
                    if c["arch"] == arch and c["dtype"] == dtype}  # fmt: skip
        assert buckets == compiled, (arch, dtype)
