"""PlatConfig, PlatForCausalLM and PlatForImageClassification held to transformers' own model-test bar, on the
tests' device (tests/device.py). Random inputs are drawn on the CPU and moved, so every device sees the same
values."""

import copy
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    ViTConfig,
    ViTForImageClassification,
)
from transformers.cache_utils import Cache, DynamicCache

from device import DEVICE, ON_CUDA
from modeling_plat import (
    PlatConfig,
    PlatForCausalLM,
    PlatForImageClassification,
    PlatModel,
    PlatVisionModel,
    plap_attention_weights,
)
from modeling_plat.cache_name import CACHE_NAME
from modeling_plat.convert import convert_to_plat
from modeling_plat.modeling_plat import apply_rotary
from reference import reference_plap_attention
from tiny import LLAMA_SHAPE, TEXT_SHAPES, classifier, lm, text_config, train_losses


@pytest.fixture(params=sorted(TEXT_SHAPES))
def shape(request):
    """The language model's config fields of one decoder shape (GPT-2 or Llama), for the tests of both."""
    return TEXT_SHAPES[request.param]


# ---------------------------------------------------------------- config


def test_default_config_builds_silently(caplog):
    with caplog.at_level(logging.DEBUG):
        config = PlatConfig()
    assert not caplog.records
    assert config.plap_p == [1.5] * 4 + [2.5] * 4  # the paper's head mix by default
    assert not any(name.startswith("encoder") for name in config.to_dict())


def test_config_round_trips_through_json(tmp_path):
    config = text_config(
        plap_p=[[1.5, 2.5, 2.0, 3.0], [1.1, 1.5, 2.5, 2.5]], output_attentions=True, output_hidden_states=True,
        return_dict=False, dtype="bfloat16", id2label={0: "a", 1: "b", 2: "c"},
        problem_type="multi_label_classification", use_cache=False, plap_formulation="euler",
    )
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(reloaded, PlatConfig)
    assert reloaded.to_diff_dict() | {"_name_or_path": ""} == config.to_diff_dict() | {"_name_or_path": ""}
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["plap_p"] == [[1.5, 2.5, 2.0, 3.0], [1.1, 1.5, 2.5, 2.5]]
    assert saved["plap_formulation"] == "euler" and saved["plap_backend"] == "auto" and saved["plap_eps"] == 1e-6
    assert (reloaded.output_attentions, reloaded.return_dict, reloaded.use_cache) == (True, False, False)
    assert reloaded.dtype == torch.bfloat16 and reloaded.num_labels == 3


def test_llama_shape_config_fields(tmp_path):
    config = text_config(**LLAMA_SHAPE)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert reloaded.to_dict() | {"_name_or_path": ""} == config.to_dict() | {"_name_or_path": ""}
    assert (config.num_key_value_heads, config.head_dim) == (2, 8)
    gpt2_shape = text_config()
    assert (gpt2_shape.num_key_value_heads, gpt2_shape.head_dim) == (4, 8)  # resolved, as transformers' configs are
    assert gpt2_shape.to_dict()["head_dim"] is None  # config.json keeps what was given
    gpt2_shape.num_attention_heads = 2  # set after init, as --config_overrides does: the unset fields follow
    assert (gpt2_shape.num_key_value_heads, gpt2_shape.head_dim) == (2, 16)
    assert not hasattr(text_config(), "rope_parameters")  # learned positions carry no rotary settings (GPT2Config)
    legacy = text_config(position_embedding_type="rope", rope_scaling={"type": "default", "rope_theta": 1e6})
    assert legacy.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    wide = text_config(**LLAMA_SHAPE, head_dim=12)  # head_dim need not be hidden_size / heads
    assert PlatForCausalLM(wide).model.layers[0].attention.q_proj.weight.shape == (48, 32)


def test_attention_bias_sets_the_query_key_value_and_output_biases_as_llama_does(tmp_path):
    attention = PlatForCausalLM(text_config(**LLAMA_SHAPE, attention_bias=True)).model.layers[0].attention
    assert all(getattr(attention, name).bias is not None for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    config = text_config(attention_bias=False)
    assert (config.qkv_bias, config.o_proj_bias, config.attention_bias) == (False, False, False)
    config.save_pretrained(tmp_path)
    assert (AutoConfig.from_pretrained(tmp_path).qkv_bias, AutoConfig.from_pretrained(tmp_path).o_proj_bias) == (False, False)
    assert text_config(qkv_bias=True, o_proj_bias=False).attention_bias is None  # Qwen2's q/k/v-only biases
    config.attention_bias = True  # set after init, as --config_overrides does
    assert (config.qkv_bias, config.o_proj_bias) == (True, True)
    with pytest.raises(ValueError, match="attention_bias"):
        text_config(attention_bias="yes")


@pytest.mark.parametrize("fields, message", [
    (dict(position_embedding_type="rope", rope_parameters={"rope_type": "ntk"}), "rope_type must be one of"),
    (dict(position_embedding_type="rope", rope_scaling={"type": "linear"}), "'factor'"),
    (dict(position_embedding_type="rope", partial_rotary_factor=1.5), "partial_rotary_factor"),
    (dict(position_embedding_type="rope", partial_rotary_factor=0.4), "even number"),
    (dict(rope_theta=1e4), "position_embedding_type='rope'"),
    (dict(position_embedding_type="alibi"), "position_embedding_type"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(norm_type="batchnorm"), "norm_type"),
    (dict(mlp_type="moe"), "mlp_type"),
    (dict(hidden_act="swishy"), "hidden_act"),
    (dict(position_embedding_type="rope", head_dim=7), "rotate pairs of features"),
])
def test_bad_decoder_shapes_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        text_config(**fields)


def test_fields_set_after_init_are_checked_as_overrides_are():
    config = text_config(**LLAMA_SHAPE)
    config.rope_parameters = {"rope_type": "yarn"}
    with pytest.raises(ValueError, match="'factor'"):
        config.validate_plat()
    learned = text_config()
    learned.position_embedding_type = "rope"
    learned.validate_plat()
    assert learned.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_checkpoint_saved_before_the_llama_shapes_loads_with_its_weights_and_logits():
    """tests/fixtures/plat-lm-3c7952d was saved by the code at commit 3c7952d (GPT-2 shape, no decoder-shape
    fields in its config.json), with the logits that code computed. Weights load bit for bit; logits agree to
    float32 rounding only, since CPUs of one kind sum matmuls in different orders (AVX2 or AVX-512 kernels)."""
    folder = Path(__file__).parents[1] / "fixtures" / "plat-lm-3c7952d"
    expected = torch.load(folder / "expected.pt", map_location=DEVICE)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert "position_embedding_type" not in json.loads((folder / "config.json").read_text())
    saved = load_file(folder / "model.safetensors")
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in saved.items())
    model = model.to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(model(expected["input_ids"]).logits, expected["logits"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "tiled", "triton"])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_grouped_query_attention_matches_the_reference_with_repeated_kv(backend, num_kv_heads):
    """Each query head reads key/value head h // (H / H_kv) with its own p: the float64 reference on the
    key/value heads repeated that way. Causal, with a padded row: outputs and the gradient of the layer's input;
    then two new tokens on top of a cache of five (DynamicCache with H_kv heads), also through the decode backend."""
    if backend == "triton":
        pytest.importorskip("triton")
    p = [1.5, 2.5, 1.2, 3.0]
    model = lm(**LLAMA_SHAPE | dict(num_key_value_heads=num_kv_heads, plap_p=p, plap_backend=backend)).to(DEVICE)
    attention = model.model.layers[0].attention
    hidden = torch.randn(2, 7, 32).to(DEVICE).requires_grad_()
    mask = torch.ones(2, 7, dtype=torch.bool, device=DEVICE)
    mask[1, :2] = False
    position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
    rotary = model.model.rotary_emb(hidden, position_ids)
    out, _ = attention(hidden, mask[:, None, None, :], None, False, rotary)
    (grad,) = torch.autograd.grad(out.square().sum(), hidden)

    def project(name, heads, x):
        weight = getattr(attention, name).weight.double()
        return (x @ weight.T).view(2, 7, heads, 8).transpose(1, 2)  # (B, heads, N, d)

    x = hidden.detach().double().requires_grad_()
    cos, sin = (t.double() for t in rotary)
    q, k = apply_rotary(project("q_proj", 4, x), cos, sin), apply_rotary(project("k_proj", num_kv_heads, x), cos, sin)
    v = project("v_proj", num_kv_heads, x)
    repeats = 4 // num_kv_heads
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    expected = reference_plap_attention(q, k, v, p, mask[:, None, None, :], is_causal=True)
    expected = expected.transpose(1, 2).reshape(2, 7, 32) @ attention.o_proj.weight.double().T
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad.float(), rtol=1e-4, atol=1e-4)

    for step_backend in (backend, "decode"):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model.config.plap_backend = backend
            attention(hidden[:, :5], mask[:, None, None, :5], cache, False, tuple(t[:, :5] for t in rotary))
            assert cache.layers[0].keys.shape == (2, num_kv_heads, 5, 8)
            model.config.plap_backend = step_backend
            step, _ = attention(hidden[:, 5:], mask[:, None, None, :], cache, False, tuple(t[:, 5:] for t in rotary))
        torch.testing.assert_close(step, expected[:, 5:].float(), rtol=1e-4, atol=1e-5)


def test_rotary_positions_have_no_length_limit_but_learned_ones_do():
    ids = torch.randint(2, 61, (1, 50))  # max_position_embeddings is 40
    assert lm(**LLAMA_SHAPE).to(DEVICE)(ids.to(DEVICE)).logits.shape == (1, 50, 61)
    # On the CPU: the limit is a host read of the positions, made for CPU tensors only (_check_range); on a GPU a
    # position past the table is a device-side assert, after which no other test could run.
    with pytest.raises(ValueError, match="max_position_embeddings"):
        lm()(ids)


# ---------------------------------------------------------------- p = 2 is softmax attention


def test_p2_language_model_equals_gpt2():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=61, n_positions=40,
                                      bos_token_id=0, eos_token_id=0)).eval().to(DEVICE)
    plat = convert_to_plat(gpt2, plap_p=2.0).to(DEVICE)
    ids = torch.randint(0, 61, (3, 17)).to(DEVICE)
    torch.testing.assert_close(plat(ids).logits, gpt2(ids).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(convert_to_plat(gpt2).to(DEVICE)(ids).logits, gpt2(ids).logits, atol=1e-3)


def test_p2_classifier_equals_vit():
    torch.manual_seed(0)
    vit = ViTForImageClassification(ViTConfig(num_hidden_layers=2, hidden_size=24, num_attention_heads=3,
                                              intermediate_size=48, image_size=16, patch_size=4,
                                              num_labels=5)).eval().to(DEVICE)
    plat = convert_to_plat(vit, plap_p=2.0).to(DEVICE)
    pixels = torch.randn(2, 3, 16, 16).to(DEVICE)
    torch.testing.assert_close(plat(pixels).logits, vit(pixels).logits, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- language model


def test_lm_outputs_and_loss(shape):
    model = lm(**shape).to(DEVICE)
    ids = torch.randint(2, 61, (2, 9)).to(DEVICE)
    out = model(ids, labels=ids, output_attentions=True, output_hidden_states=True)
    assert out.logits.shape == (2, 9, 61)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 61), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert isinstance(getattr(out, CACHE_NAME), Cache)
    key_cache = getattr(out, CACHE_NAME).layers[0].keys
    assert key_cache.shape == (2, model.config.num_key_value_heads, 9, 8)  # (B, key/value heads, T, head_dim)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (2, 4, 9, 9) and out.attentions[0].requires_grad
    as_tuple = model(ids, labels=ids, output_attentions=True, return_dict=False)
    torch.testing.assert_close(as_tuple[-1][0], out.attentions[0])


def test_attentions_are_the_effective_weights():
    model = lm(plap_p=[1.5, 2.5, 2.0, 3.0]).to(DEVICE)
    ids = torch.randint(2, 61, (1, 6)).to(DEVICE)
    out = model(ids, output_attentions=True, output_hidden_states=True)
    layer = model.model.layers[0]
    hidden = layer.attn_norm(out.hidden_states[0])
    q = layer.attention.q_proj(hidden).view(1, 6, 4, 8).transpose(1, 2)
    k = layer.attention.k_proj(hidden).view(1, 6, 4, 8).transpose(1, 2)
    v = layer.attention.v_proj(hidden).view(1, 6, 4, 8).transpose(1, 2)
    expected = plap_attention_weights(q, k, v, torch.tensor([1.5, 2.5, 2.0, 3.0], device=DEVICE),
                                      is_causal=True)
    torch.testing.assert_close(out.attentions[0], expected)
    assert (out.attentions[0][:, :3].sum(-1) - 1).abs().max() > 1e-3  # rows of A * P need not sum to 1


@pytest.mark.parametrize("argument", ["cache", "past_key_values"])  # transformers >= 5.24 passes cache=
def test_incremental_decoding_matches_full_forward(argument, shape):
    model = lm(**shape).to(DEVICE)
    # Repeated tokens (a vocabulary of 6): with rotary positions their first-layer values are equal, D2 = 0 pairs that
    # the full forward (expansion) and the cached steps (direct differences) must weigh alike.
    ids = torch.randint(2, 8, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    full = model(ids, use_cache=False).logits
    prefix = model(ids[:, :7], use_cache=True)
    cache, steps = getattr(prefix, CACHE_NAME), [prefix.logits]
    for t in range(7, 12):
        step = model(ids[:, t : t + 1], use_cache=True, **{argument: cache})
        cache = getattr(step, CACHE_NAME)
        steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_a_cache_under_both_names_is_refused():
    model = lm().to(DEVICE)
    cache = getattr(model(torch.randint(2, 61, (1, 4)).to(DEVICE), use_cache=True), CACHE_NAME)
    with pytest.raises(ValueError, match="Pass the KV cache once"):
        model(torch.randint(2, 61, (1, 1)).to(DEVICE), cache=cache, past_key_values=cache)


def test_trainer_predictions_leave_the_cache_out(tmp_path):
    model = lm()
    # Host rows, as a dataset holds them: the Trainer moves the model and each batch to its device (the tests' one),
    # and its data loader pins host memory on a GPU machine (CUDA tensors cannot be pinned).
    ids = torch.randint(2, 61, (3, 6))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(tmp_path, per_device_eval_batch_size=3, report_to=[], use_cpu=not ON_CUDA,
                             use_cache=True)
    predictions = Trainer(model, args).predict(dataset).predictions
    assert isinstance(predictions, np.ndarray) and predictions.shape == (3, 6, 61)


def test_trainer_label_smoothing_scores_the_next_token(tmp_path):
    """Trainer computes a smoothed loss itself, shifting the labels only for causal LMs it knows by class name."""
    model = lm()
    ids = torch.randint(2, 61, (3, 6))
    ids[0, :2] = -100  # ignored positions stay ignored
    args = TrainingArguments(tmp_path, label_smoothing_factor=0.1, report_to=[], use_cpu=not ON_CUDA)
    trainer = Trainer(model, args)
    inputs = {"input_ids": ids.clamp(min=2).to(trainer.args.device), "labels": ids.to(trainer.args.device)}
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(inputs))
        logits = model(input_ids=inputs["input_ids"]).logits.float()
    next_token = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten(),
                                                   label_smoothing=0.1)  # fmt: skip
    torch.testing.assert_close(loss, next_token)


def test_gradient_accumulation_gives_the_step_of_the_whole_batch(tmp_path):
    """Trainer passes the accumulated batch's target count (num_items_in_batch) to the model's loss: two half
    batches with different numbers of ignored labels take the step of the whole batch."""
    torch.manual_seed(0)
    rows = []
    for ignored in (0, 9, 2, 10):
        ids = torch.randint(2, 61, (12,))
        rows.append({"input_ids": ids, "labels": ids.clone().index_fill_(0, torch.arange(ignored), -100)})
    models = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = lm()  # the same weights each time
        args = TrainingArguments(tmp_path / str(accumulation), per_device_train_batch_size=batch_size,
                                 gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=0.1, optim="sgd",
                                 lr_scheduler_type="constant", max_grad_norm=0, report_to=[], use_cpu=not ON_CUDA)
        trainer = Trainer(model, args, train_dataset=rows)
        trainer._get_train_sampler = lambda *args, **kwargs: torch.utils.data.SequentialSampler(rows)
        trainer.train()
        models.append(model)
    step = [(whole - halves).abs().max() for whole, halves in zip(*(model.parameters() for model in models))]
    assert max(step) < 1e-6
    assert max((trained - initial.to(trained.device)).abs().max() for trained, initial in
               zip(models[0].parameters(), lm().parameters())) > 1e-3  # fmt: skip


@pytest.mark.parametrize("formulation", ["paper", "euler"])
def test_greedy_generate_with_and_without_cache(formulation, shape):
    model = lm(plap_formulation=formulation, **shape).to(DEVICE)
    prompt = torch.randint(2, 61, (2, 5)).to(DEVICE)
    cached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached) and cached.shape == (2, 15)


def test_sampling_beam_and_assisted_generation_run(shape):
    model = lm(**shape).to(DEVICE)
    prompt = torch.randint(2, 61, (2, 4)).to(DEVICE)
    torch.manual_seed(0)
    assert model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=10).shape == (2, 10)
    beams = model.generate(prompt, max_new_tokens=6, num_beams=3, num_return_sequences=2)
    assert beams.shape == (4, 10)
    assistant = lm(num_hidden_layers=1, **shape).to(DEVICE)
    assisted = model.generate(prompt[:1], max_new_tokens=6, do_sample=False, assistant_model=assistant)
    assert torch.equal(assisted, model.generate(prompt[:1], max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_unpadded_runs(side, shape):
    model = lm(plap_p=[1.1, 1.5, 2.5, 3.0], **shape).to(DEVICE)
    seqs = [torch.randint(2, 61, (n,)).to(DEVICE) for n in (9, 5, 7)]
    width = 9
    batch = torch.zeros(3, width, dtype=torch.long, device=DEVICE)
    mask = torch.zeros(3, width, dtype=torch.long, device=DEVICE)
    for i, s in enumerate(seqs):
        where = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        batch[i, where], mask[i, where] = s, 1
    logits = model(batch, attention_mask=mask).logits
    for i, s in enumerate(seqs):
        alone = model(s[None]).logits[0]
        where = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        torch.testing.assert_close(logits[i, where], alone, rtol=1e-5, atol=1e-5)


def test_left_padded_generation_equals_unpadded(shape):
    model = lm(**shape).to(DEVICE)
    short, long = torch.randint(2, 61, (4,)).to(DEVICE), torch.randint(2, 61, (6,)).to(DEVICE)
    batch = torch.stack([torch.cat([torch.zeros(2, dtype=torch.long, device=DEVICE), short]), long])
    mask = (torch.arange(6, device=DEVICE)[None] >= torch.tensor([[2], [0]], device=DEVICE)).long()
    out = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False)
    alone = model.generate(short[None], max_new_tokens=5, do_sample=False)
    assert torch.equal(out[0, 2:], alone[0])


def test_inputs_embeds_and_position_ids(shape):
    model = lm(**shape).to(DEVICE)
    ids = torch.randint(2, 61, (2, 6)).to(DEVICE)
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(ids).logits)
    # Spread, not shifted: rotary positions see only the distances between tokens.
    spread = model(ids, position_ids=torch.tensor([[0, 2, 3, 5, 8, 9]], device=DEVICE).expand(2, -1)).logits
    assert not torch.allclose(spread, model(ids).logits)


# ---------------------------------------------------------------- vision


def test_classifier_single_multi_label_and_regression_losses():
    pixels = torch.randn(4, 3, 16, 16).to(DEVICE)
    model = classifier().to(DEVICE)
    labels = torch.tensor([0, 1, 4, 2], device=DEVICE)
    out = model(pixels, labels=labels, output_attentions=True, output_hidden_states=True)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    assert out.attentions[0].shape == (4, 3, 17, 17) and len(out.hidden_states) == 3
    multi = classifier(problem_type="multi_label_classification").to(DEVICE)
    targets = (torch.rand(4, 5) > 0.5).float().to(DEVICE)
    out = multi(pixels, labels=targets)
    torch.testing.assert_close(out.loss, torch.nn.functional.binary_cross_entropy_with_logits(out.logits, targets))
    regression = classifier(num_labels=1).to(DEVICE)
    out = regression(pixels, labels=torch.randn(4).to(DEVICE))
    assert out.logits.shape == (4, 1) and out.loss.ndim == 0


def test_classifier_single_channel_and_interpolated_positions():
    model = classifier(num_channels=1).to(DEVICE)
    assert model(torch.randn(2, 1, 16, 16).to(DEVICE)).logits.shape == (2, 5)
    assert model(torch.randn(2, 1, 24, 32).to(DEVICE), interpolate_pos_encoding=True).logits.shape == (2, 5)
    same = model(torch.randn(2, 1, 16, 16).to(DEVICE), interpolate_pos_encoding=True)
    assert same.logits.shape == (2, 5)


def test_reload_with_other_num_labels(tmp_path):
    classifier().save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes|size mismatch"):
        PlatForImageClassification.from_pretrained(tmp_path, num_labels=7)
    model = PlatForImageClassification.from_pretrained(tmp_path, num_labels=7, ignore_mismatched_sizes=True)
    assert model.to(DEVICE)(torch.randn(1, 3, 16, 16).to(DEVICE)).logits.shape == (1, 7)


# ---------------------------------------------------------------- both families


@pytest.mark.parametrize("family", ["text", "vision"])
def test_gradient_checkpointing_gives_the_same_gradients(family):
    model = (lm(hidden_dropout_prob=0.0, **LLAMA_SHAPE) if family == "text" else classifier()).to(DEVICE)
    inputs = (dict(input_ids=torch.randint(2, 61, (2, 8)), labels=torch.randint(2, 61, (2, 8)))
              if family == "text" else dict(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.tensor([1, 3])))
    inputs = {name: tensor.to(DEVICE) for name, tensor in inputs.items()}
    model.train()
    model(**inputs).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # transformers 5.17 has only gradient_checkpointing_enable; later versions rename it (the old name warns).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert all(layer.gradient_checkpointing for layer in model.modules() if hasattr(layer, "gradient_checkpointing"))
    model(**inputs).loss.backward()
    for name, grad in plain.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama", "vision"])
def test_save_load_round_trip_through_auto_classes(tmp_path, family):
    if family == "vision":
        model = classifier(plap_p=[[1.5, 2.0, 2.5], [3.0, 1.1, 1.5]]).to(DEVICE)
    else:
        model = lm(**TEXT_SHAPES[family]).to(DEVICE)
    auto = AutoModelForImageClassification if family == "vision" else AutoModelForCausalLM
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "pytorch_model.bin").exists()
    reloaded = auto.from_pretrained(tmp_path).eval().to(DEVICE)
    assert type(reloaded) is type(model)
    inputs = (torch.randn(2, 3, 16, 16) if family == "vision" else torch.randint(2, 61, (2, 7))).to(DEVICE)
    # Exact: the same weights through the same kernels on the same device.
    torch.testing.assert_close(reloaded(inputs).logits, model(inputs).logits, rtol=0, atol=0)
    for layer, reloaded_layer in zip(model.base_model.layers, reloaded.base_model.layers):
        assert layer.attention.p_values == reloaded_layer.attention.p_values
    trunk = PlatVisionModel.from_pretrained(tmp_path) if family == "vision" else AutoModel.from_pretrained(tmp_path)
    assert type(trunk) is (PlatVisionModel if family == "vision" else PlatModel)


def test_tied_or_untied_lm_head_and_meta_device_init(shape):
    model = lm(**shape).to(DEVICE)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == model.config.tie_word_embeddings
    with torch.device("meta"):
        meta = PlatForCausalLM(text_config(plap_p=[1.1, 1.5, 2.5, 3.0], **shape))
    meta = meta.to_empty(device=DEVICE)
    meta.init_weights()
    for module in meta.modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            assert torch.isfinite(tensor).all(), name
    assert meta.model.layers[1].attention.p_values == (1.1, 1.5, 2.5, 3.0)
    if model.model.rotary_emb is not None:  # a buffer that init must rebuild, not leave as uninitialised memory
        assert torch.equal(meta.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)


def test_deterministic_in_eval_and_batch_size_invariant(shape):
    model = lm(**shape).to(DEVICE)
    ids = torch.randint(2, 61, (4, 10)).to(DEVICE)
    first, second = model(ids).logits, model(ids).logits
    assert torch.equal(first, second)
    torch.testing.assert_close(model(ids[:1]).logits, first[:1], rtol=1e-5, atol=1e-6)


def test_training_step_lowers_the_loss_with_the_paper_mix():
    ids = torch.randint(2, 61, (4, 16)).to(DEVICE)
    losses = train_losses(lm().to(DEVICE), 15, 3e-3, input_ids=ids, labels=ids)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.7 * losses[0]


def test_p_survives_copies_and_dtype_casts():
    model = lm(plap_p=[1.1, 1.5, 2.5, 3.0]).to(DEVICE)
    clone = copy.deepcopy(model).to(torch.bfloat16)
    assert clone.model.layers[0].attention.p_values == (1.1, 1.5, 2.5, 3.0)  # Python floats: nothing to round
    ids = torch.randint(2, 61, (2, 6)).to(DEVICE)
    torch.testing.assert_close(clone(ids).logits.float(), model(ids).logits, rtol=0.1, atol=0.1)
