"""generate() as transformers defines it, on PlatForCausalLM (both shapes) and on a transformers model with
attn_implementation="plap": greedy, sampling, beam search, assisted decoding, from inputs_embeds, logits_to_keep,
with left- and right-padded attention masks (transformers only warns about right padding; so must we)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import modeling_plat  # noqa: F401  (registers attn_implementation="plap")
from device import DEVICE
from modeling_plat.cache_name import CACHE_NAME
from modeling_plat.packing import packed_document_ids
from tiny import LLAMA_SHAPE, TEXT_SHAPES, lm

MODELS = ["plat-gpt2", "plat-llama", "llama-plap"]
NEW_TOKENS = 5


def model(name):
    if name == "llama-plap":
        config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
        torch.manual_seed(0)
        return LlamaForCausalLM._from_config(config, attn_implementation="plap").to(DEVICE).eval()
    return lm(**TEXT_SHAPES[name.removeprefix("plat-")]).to(DEVICE)


def prompts(padding):
    """Three rows of 7 tokens, the first two padded by 2 and 1 on the ``padding`` side (or not at all)."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(2, 61, (3, 7), generator=generator).to(DEVICE)
    attention_mask = torch.ones_like(input_ids)
    if padding == "left":
        attention_mask[0, :2] = attention_mask[1, :1] = 0
    elif padding == "right":
        attention_mask[0, -2:] = attention_mask[1, -1:] = 0
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


def generate(lm_model, padding, **kwargs):
    input_ids, attention_mask = prompts(padding)
    return lm_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0, **kwargs)  # fmt: skip


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_and_beam_search_with_and_without_cache(name, padding):
    lm_model = model(name)
    for mode in (dict(do_sample=False), dict(do_sample=False, num_beams=2)):
        cached = generate(lm_model, padding, **mode)
        assert cached.shape == (3, 7 + NEW_TOKENS)
        assert torch.equal(cached, generate(lm_model, padding, use_cache=False, **mode))


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("name", MODELS)
def test_sampling_and_assisted_decoding(name, padding):
    lm_model = model(name)
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(5)
        sampled.append(generate(lm_model, padding, do_sample=True, top_k=5, use_cache=use_cache))
    assert torch.equal(*sampled)
    # Assisted decoding (by the model itself, and by prompt lookup; one row, as transformers requires) is greedy
    # decoding, its candidates verified several tokens at a time against the cache.
    input_ids, attention_mask = prompts(padding)
    options = dict(attention_mask=attention_mask[1:2], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    greedy = lm_model.generate(input_ids[1:2], **options)
    for assistant in (dict(assistant_model=lm_model), dict(prompt_lookup_num_tokens=2)):
        assert torch.equal(lm_model.generate(input_ids[1:2], **options, **assistant), greedy)


@pytest.mark.parametrize("name", MODELS)
def test_generate_from_inputs_embeds_and_logits_to_keep(name):
    lm_model = model(name)
    input_ids, attention_mask = prompts("left")
    greedy = generate(lm_model, "left", do_sample=False)
    embeds = lm_model.get_input_embeddings()(input_ids)
    from_embeds = lm_model.generate(inputs_embeds=embeds, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)  # fmt: skip
    assert torch.equal(from_embeds, greedy[:, 7:])  # generate returns only the new tokens
    with torch.no_grad():
        logits = lm_model(input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(lm_model(input_ids, attention_mask=attention_mask, logits_to_keep=2).logits,
                                   logits[:, -2:])


def test_padding_is_never_a_document_start():
    """generate gives padding position 0: right padding, and padding between packed documents, start no document."""
    position_ids = torch.tensor([[0, 1, 2, 0, 0], [0, 1, 0, 1, 2], [0, 1, 0, 0, 1]], device=DEVICE)
    attention_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 1, 1]], device=DEVICE)
    documents = packed_document_ids(position_ids, attention_mask, batch=3, length=5, cache_given=False)
    expected = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], device=DEVICE)
    assert torch.equal(documents, expected)
    right_padded = packed_document_ids(position_ids[:1], attention_mask[:1], batch=1, length=5, cache_given=True)
    assert right_padded is None
    with pytest.raises(ValueError, match="packed documents"):
        packed_document_ids(position_ids[1:], attention_mask[1:], batch=2, length=5, cache_given=True)


@pytest.mark.parametrize("shape", sorted(TEXT_SHAPES))
def test_right_padding_gives_the_real_tokens_their_logits(shape):
    lm_model = lm(**TEXT_SHAPES[shape]).to(DEVICE)
    input_ids, attention_mask = prompts("right")
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # as generate makes them
    with torch.no_grad():
        padded = lm_model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        alone = lm_model(input_ids[:1, :5]).logits
    torch.testing.assert_close(padded[0, :5], alone[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", sorted(TEXT_SHAPES))
def test_a_layer_that_a_device_map_offloads_changes_nothing(shape, tmp_path):
    """Big-model inference through accelerate, ``from_pretrained(..., device_map=...)``: the second layer's weights on
    disk, which accelerate's hooks load at each call, the rest on the tests' device; logits and greedy continuations of
    padded prompts are the model's own."""
    lm_model = lm(**TEXT_SHAPES[shape]).to(DEVICE)
    lm_model.save_pretrained(tmp_path / "model")
    here = (DEVICE.index or 0) if DEVICE.type == "cuda" else "cpu"
    device_map = {f"model.{name}": here for name, _ in lm_model.model.named_children() if name != "layers"}
    device_map |= {"model.layers.0": here, "model.layers.1": "disk", "lm_head": here}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                     offload_folder=tmp_path / "offload").eval()  # fmt: skip
    assert offloaded.hf_device_map["model.layers.1"] == "disk"
    input_ids, attention_mask = prompts("left")
    with torch.no_grad():
        expected, actual = (m(input_ids, attention_mask=attention_mask).logits for m in (lm_model, offloaded))
    torch.testing.assert_close(actual, expected)
    assert torch.equal(generate(offloaded, "left", do_sample=False), generate(lm_model, "left", do_sample=False))


@pytest.mark.parametrize("fields, heads", [({}, (4, 8)), (dict(LLAMA_SHAPE, head_dim=12), (2, 12))],
                         ids=["gpt2", "llama-head_dim"])  # fmt: skip
def test_the_cache_has_the_key_value_heads_and_head_dim_that_the_config_reads(fields, heads):
    """transformers' generation and its checks of a cache read its shape from config.num_key_value_heads and
    config.head_dim: they read as numbers (unset: the query heads, hidden_size / heads), and each layer's keys and
    values are (B, num_key_value_heads, T, head_dim), after a forward and after generate."""
    model = lm(**fields).to(DEVICE)
    config = model.config
    assert (config.num_key_value_heads, config.head_dim) == heads
    input_ids, _ = prompts("none")
    caches = {7: getattr(model(input_ids, use_cache=True), CACHE_NAME)}
    generated = model.generate(input_ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    caches[9] = getattr(generated, CACHE_NAME)  # the last new token's keys are not computed
    for length, cache in caches.items():
        assert len(cache.layers) == config.num_hidden_layers
        for layer in cache.layers:
            assert layer.keys.shape == layer.values.shape == (3, heads[0], length, heads[1])
