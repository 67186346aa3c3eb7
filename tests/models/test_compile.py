"""torch.compile, torch.export and ONNX see the whole model: no graph break in any layer, fullgraph forward and
backward equal eager, training steps on batches of new sizes in one graph of symbolic sizes, exported programs with
dynamic batch and length equal eager at other shapes; on the tests' device (tests/device.py), and on a GPU also
compiled by Inductor."""

import importlib

import pytest
import torch
from device import DEVICE, ON_CUDA, needs_cuda
from tiny import TEXT_SHAPES, lm
from transformers import DataCollatorWithFlattening

from modeling_plat import plap_attention
from modeling_plat.triton_configs import INTERPRETER_CONFIG

P_MIX = [1.5, 1.5, 2.5, 2.0]  # both powers and one softmax head: every path of the attention


def training_step(model):
    def step(ids):
        return model(ids, labels=ids).loss

    return step


def requires(backend):
    if backend == "triton":  # the fused kernels, run by the Triton interpreter on CPU (tests/conftest.py)
        pytest.importorskip("triton")


def without_dropout(model):
    """The model on the tests' device with its dropout off: compiled and eager steps then draw no random numbers."""
    model.config.hidden_dropout_prob = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(DEVICE)


def token_ids(*shape, seed=0):
    """Token ids drawn on the CPU (the same on every device), on the tests' device."""
    return torch.randint(2, 61, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("backend", ["auto", "eager", "tiled", "triton"])
@pytest.mark.parametrize("shape", TEXT_SHAPES)
def test_no_graph_break_in_a_training_step(shape, backend):
    requires(backend)
    model = lm(**TEXT_SHAPES[shape], plap_p=P_MIX, plap_backend=backend, use_cache=False).train().to(DEVICE)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(training_step(model))(token_ids(2, 12))
    assert explained.graph_break_count == 0, [str(reason.reason)[:200] for reason in explained.break_reasons]
    assert explained.graph_count == 1


# aot_eager runs the traced graph's own operations: only the trace can differ from eager. Inductor generates kernels
# (Triton on a GPU; on the CPU it needs a C++ compiler and minutes): fused reductions reorder float32 sums.
COMPILERS = {"aot_eager": dict(rtol=1e-4, atol=1e-6), "inductor": dict(rtol=1e-3, atol=1e-5)}


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=needs_cuda)])
@pytest.mark.parametrize("backend", ["eager", "tiled", "triton"])
@pytest.mark.parametrize("shape", TEXT_SHAPES)
def test_fullgraph_forward_and_backward_equal_eager(shape, backend, compiler):
    requires(backend)
    model = without_dropout(lm(**TEXT_SHAPES[shape], plap_p=P_MIX, plap_backend=backend, use_cache=False).train())
    ids = token_ids(2, 12)
    expected_loss = model(ids, labels=ids).loss
    expected = torch.autograd.grad(expected_loss, list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(training_step(model), backend=compiler, fullgraph=True)
    loss = compiled(ids)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, expected_loss, **COMPILERS[compiler])
    for grad, reference in zip(grads, expected):
        torch.testing.assert_close(grad, reference, **COMPILERS[compiler])


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=needs_cuda)])
@pytest.mark.parametrize("backend", [pytest.param("eager", marks=pytest.mark.slow), "tiled", "triton"])
def test_batches_of_new_sizes_share_one_graph_with_symbolic_sizes(backend, compiler):
    """Training on batches of varying sizes (padding to each batch's longest): the second size recompiles with the batch
    and length symbolic, as torch.compile does by default, and that graph, traced whole, runs every later size as
    eager does."""
    requires(backend)
    model = without_dropout(lm(plap_p=P_MIX, plap_backend=backend, use_cache=False).train())
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend(compiler)(graph, example_inputs)

    step = training_step(model)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=counting_backend, fullgraph=True)
    for seed, (batch, length) in enumerate([(2, 12), (3, 17), (2, 7)]):  # sizes 0 and 1 are always specialized
        ids = token_ids(batch, length, seed=seed)
        expected_loss = step(ids)
        expected = torch.autograd.grad(expected_loss, list(model.parameters()))
        loss = compiled(ids)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        torch.testing.assert_close(loss, expected_loss, **COMPILERS[compiler])
        for grad, reference in zip(grads, expected):
            torch.testing.assert_close(grad, reference, **COMPILERS[compiler])
    assert len(graphs) == 2


def test_fullgraph_packed_rows_equal_eager():
    """Under compilation the document boundaries cannot be read on the host: they stay a tensor."""
    model = lm(plap_p=P_MIX, use_cache=False).to(DEVICE)
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": list(range(2, 2 + n))} for n in (5, 9)])
    batch = {name: tensor.to(DEVICE) for name, tensor in batch.items()}
    with torch.no_grad():
        expected = model(batch["input_ids"], position_ids=batch["position_ids"]).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(batch["input_ids"], position_ids=batch["position_ids"]).logits, expected)


def exported(model, example):
    # Named Dims: export fails on any guard that the bounds do not imply (e.g. a decode path for <= 4 queries taken
    # while tracing would narrow the length to >= 5), so the program runs every length in [2, 40].
    batch, length = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("length", min=2, max=40)
    return torch.export.export(model, (), {"input_ids": example},
                               dynamic_shapes={"input_ids": {0: batch, 1: length}}, strict=False)  # fmt: skip


@pytest.mark.parametrize("backend", ["auto", "eager", "tiled"])
@pytest.mark.parametrize("shape", TEXT_SHAPES)
def test_export_with_dynamic_batch_and_length(shape, backend):
    model = lm(**TEXT_SHAPES[shape], plap_p=P_MIX, plap_backend=backend, use_cache=False).to(DEVICE)
    program = exported(model, token_ids(2, 12))
    for other in (token_ids(3, 17, seed=1), token_ids(1, 2, seed=2)):  # the lower bound: as few queries as decoding
        with torch.no_grad():
            torch.testing.assert_close(program.module()(input_ids=other).logits, model(other).logits)


@pytest.mark.parametrize("shape", TEXT_SHAPES)
def test_onnx_export_runs_in_onnxruntime(tmp_path, shape):
    # On the CPU on every machine: the exported file runs in onnxruntime's CPU provider.
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = lm(**TEXT_SHAPES[shape], plap_p=P_MIX, use_cache=False)
    batch, length = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("length", min=2, max=40)
    path = tmp_path / "plat.onnx"
    torch.onnx.export(model, (), path, kwargs={"input_ids": torch.randint(2, 61, (2, 12))}, dynamo=True,
                      dynamic_shapes={"input_ids": {0: batch, 1: length}}, output_names=["logits"])  # fmt: skip
    # Words from a vocabulary of 8: repeated tokens, whose equal first-layer values (rotary positions) put D2 = 0
    # pairs where P is steepest (docs/numerics.md).
    other = torch.randint(2, 10, (3, 17), generator=torch.Generator().manual_seed(0))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits, *_) = session.run(["logits"], {session.get_inputs()[0].name: other.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model(other).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layers", [2, pytest.param(16, marks=pytest.mark.slow)])
def test_compiled_decoding_with_the_cache_compiles_three_graphs(layers):
    """The prompt, the first step, then one graph whose cache length is symbolic, at any depth (16: the paper's
    model) far from the recompile limit; the tokens are those of eager decoding."""
    model = lm(num_hidden_layers=layers, plap_p=P_MIX, max_position_embeddings=64).to(DEVICE)
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    prompt = token_ids(2, 6)
    generate = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(prompt, **generate)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend=counting_backend, fullgraph=True)
        tokens = model.generate(prompt, **generate)
    assert torch.equal(tokens, expected)
    assert len(graphs) == 3


@pytest.mark.parametrize("backend", ["tiled", "triton"])
@pytest.mark.parametrize("euler", [False, True], ids=["paper", "euler"])
def test_fused_backends_custom_ops_pass_opcheck(backend, euler):
    """torch.library's own checks of the ops that compile and export see: schema, fake shapes, autograd."""
    requires(backend)
    module = importlib.import_module(f"modeling_plat.plap_attention_{backend}")
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 3, 9, 8, generator=generator).to(DEVICE).requires_grad_() for _ in range(3))
    if backend == "tiled":
        args = (query, key, value, None, None, [-0.25, 0.25, -0.25], True, 1e-6, euler, None)
    else:
        config = (module.launch_config(torch.float32, 8, 8, torch.cuda.get_device_capability(DEVICE)) if ON_CUDA
                  else INTERPRETER_CONFIG)  # fmt: skip
        args = (query, key, value, None, None, [1.5, 2.5, 1.5], True, 0, 1e-6, euler, module._flat(config))
    torch.library.opcheck(module._forward_op, args)


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_eager_calls_skip_the_custom_op_dispatcher_with_the_same_results(monkeypatch, backend):
    """Eager mode runs a fused backend's functions through a plain autograd Function (host time that small shapes
    on a GPU wait for); the custom op, which traced graphs call, gives bitwise the same output and gradients."""
    requires(backend)
    module = importlib.import_module(f"modeling_plat.plap_attention_{backend}")
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 3, 9, 8, generator=generator).to(DEVICE).requires_grad_() for _ in range(3)]
    p = (1.5, 2.5, 1.5)

    def run():
        out = plap_attention(*inputs, p, is_causal=True, backend=backend)
        return out, *torch.autograd.grad(out, inputs, torch.ones_like(out))

    op_calls = []
    op = module._fused.forward_op
    monkeypatch.setattr(module._fused, "forward_op", lambda *args: op_calls.append(1) or op(*args))
    eager = run()
    assert not op_calls
    monkeypatch.setattr(type(module._fused), "__call__", lambda self, *args: self.forward_op(*args))
    through_op = run()
    assert op_calls
    for ours, theirs in zip(eager, through_op):
        assert torch.equal(ours, theirs)
