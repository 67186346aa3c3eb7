"""What torch.compile's graphs of a fused attention call copy, traced on a machine without a GPU.

torch.compile traces the Triton backend's ops (``triton_op``s) into its graphs: each launch becomes a functional node
that writes into clones of the tensors its kernel writes (torch's analysis of the kernel, as
``triton_aot.written_arguments`` checks it launch by launch), and Inductor's reinplacing then lets the kernel write
into the tensors themselves wherever the graph reads nothing of them afterwards. A clone that stays is a copy of that
tensor (the output, the statistics, a gradient) at every call, which eager calls do not make.

``traced_graphs(case)`` traces one call's forward and backward as torch.compile does with Inductor: AOTAutograd's joint
graph split by Inductor's partitioner, on CPU tensors with the launch configuration of the case's GPU
(``triton_aot``'s cases: architecture, dtype, head sizes, flags, lengths) and torch's analysis of the kernels for that
architecture (``triton_aot.torch_analysis_for``). ``graph_report`` runs Inductor's reinplacing on a graph and lists
its launches, each with the tensors it still clones, and its other operations. The kernels must run compiled, not
interpreted, so this runs in a process without TRITON_INTERPRET:

    python tools/kernels/compiled_graph.py                # the default cases, one JSON line per case
    python tools/kernels/compiled_graph.py '[{...}, ...]'  # cases as JSON
"""

import collections
import json
import sys
from types import SimpleNamespace

import torch

from triton_aot import DTYPES, case_config, case_id, case_p, kernel_name, launches

# A first pass and an exact pass per kernel (lengths above ONE_PASS_PAIRS' at 2 x 3 heads), with the paper's two p;
# every branch and euler; a small call, whose kernels run their exact passes alone.
DEFAULT_CASES = [
    dict(arch=90, dtype="bfloat16", head_dim=64, value_dim=64, is_causal=True, key_mask=False, euler=False,
         p=[1.5, 2.5, 2.5], num_queries=1200, num_keys=1200),
    dict(arch=80, dtype="float16", head_dim=128, value_dim=128, is_causal=True, key_mask=True, documents=True,
         window=300, euler=True, p=3.0, num_queries=1200, num_keys=1200),
    dict(arch=90, dtype="float32", head_dim=32, value_dim=32, is_causal=False, key_mask=False, euler=False,
         p=[1.5, 2.5, 2.5], num_queries=40, num_keys=40, alone=True),
]  # fmt: skip


class _Partitioned(Exception):
    """Ends a trace once Inductor's partitioner has split its joint graph: nothing is compiled or run after."""


def call_inputs(case):
    """(query, key, value) requiring gradients, shaped as ``triton_aot.launches`` shapes a case's (2 x HEADS heads),
    and the keyword arguments of ``plap_attention_triton`` for the case."""
    from modeling_plat import plap_attention_triton as triton_module

    dtype, heads = DTYPES[case["dtype"]], len(case_p(case))
    nq, nk, d, dv = case["num_queries"], case["num_keys"], case["head_dim"], case["value_dim"]
    query, key, value = (torch.zeros(2, heads, length, size, dtype=dtype, requires_grad=True)
                         for length, size in ((nq, d), (nk, d), (nk, dv)))  # fmt: skip
    kwargs = dict(
        p=case_p(case),
        attn_mask=torch.ones(2, 1, 1, nk, dtype=torch.bool) if case["key_mask"] else None,
        is_causal=case["is_causal"],
        sliding_window=case.get("window") or None,
        document_ids=torch.arange(nk).div(nk // 2 + 1, rounding_mode="floor").expand(2, nk) if case.get("documents")
        else None,
        formulation="euler" if case["euler"] else "paper",
        config=case_config(triton_module, case),
    )  # fmt: skip
    return (query, key, value), kwargs


def traced_graphs(case):
    """{"forward": GraphModule, "backward": GraphModule} of one call's loss (the output's squares summed), as
    torch.compile with Inductor partitions them, before Inductor's own passes."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from modeling_plat.plap_attention_triton import plap_attention_triton
    from triton_aot import torch_analysis_for

    graphs = {}

    def partition(joint, joint_inputs, **kwargs):
        graphs["forward"], graphs["backward"] = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        raise _Partitioned

    inputs, kwargs = call_inputs(case)

    def loss(query, key, value):
        return plap_attention_triton(query, key, value, **kwargs).float().square().sum()

    backend = aot_autograd(fw_compiler=_never, bw_compiler=_never, partition_fn=partition)
    torch._dynamo.reset()
    with torch_analysis_for(case["arch"]) as failure:
        try:
            torch.compile(loss, backend=backend, fullgraph=True)(*inputs)
        except BackendCompilerFailed as error:
            if not isinstance(error.inner_exception, _Partitioned):
                raise
    if failure.failed:
        raise RuntimeError(f"torch's analysis of a kernel failed (it takes every tensor as written): {failure.failed}")
    return graphs


def _never(graph, example_inputs):
    raise AssertionError("the partitioner ends the trace before a graph is compiled")


def graph_report(graph):
    """(launches, operations) of a graph after Inductor's reinplacing: per launch its ``triton_aot.KERNELS`` name and
    the tensors it still clones, in the graph's order; and the count of each other operation."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops_core

    from modeling_plat import plap_attention_triton as triton_module

    reinplace_inplaceable_ops_core(graph.graph)
    launched, operations = [], collections.Counter()
    for node in graph.graph.nodes:
        if node.target is triton_kernel_wrapper_functional:
            kernel = _jit_function(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]))
            launch = SimpleNamespace(kernel=kernel, meta={"PASS": node.kwargs["kwargs"]["PASS"]})  # as kernel_name reads
            launched.append(dict(kernel=kernel_name(triton_module, launch),
                                 clones=sorted(node.kwargs["tensors_to_clone"])))  # fmt: skip
        elif node.op == "call_function" and node.target.__module__ != "_operator":  # getitem: an output's part
            operations[str(node.target)] += 1
    return launched, dict(operations)


def _jit_function(kernel):
    """The kernel that a traced launch names: torch wraps a launch with warps or stages in an autotuner of one
    configuration."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def case_report(case):
    """One case's JSON result: each graph's launches (with their clones) and operations, and the launches an eager
    call of the case makes (``triton_aot.launches``)."""
    from modeling_plat import plap_attention_triton as triton_module

    graphs = traced_graphs(case)
    result = dict(case=case_id(case), eager=[name for name, _ in launches(triton_module, case)])
    for name, graph in graphs.items():
        result[name], result[f"{name}_operations"] = graph_report(graph)
    return result


def main(argv):
    cases = json.loads(argv[0]) if argv else DEFAULT_CASES
    for case in cases:
        print(json.dumps(case_report(case)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
