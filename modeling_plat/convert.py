"""Turn a transformers GPT-2, Llama, Qwen2, Mistral or ViT checkpoint into the equivalent p-LaT model.

p-LaT adds no parameters: the weights carry over unchanged and only the attention rule changes. With
``plap_p=2.0`` the converted model computes exactly what the source model does.
"""

import re

from .configuration_plat import PlatConfig, PlatVisionConfig, paper_p_mix
from .modeling_plat import PlatForCausalLM, PlatForImageClassification, PlatVisionModel

# (source key pattern, p-LaT key) pairs; GPT-2's Conv1D weights are (in, out) and need a transpose.
_GPT2_KEYS = [
    (r"transformer\.wte\.weight", "model.embed_tokens.weight"),
    (r"transformer\.wpe\.weight", "model.embed_positions.weight"),
    (r"transformer\.h\.(\d+)\.ln_1\.(weight|bias)", r"model.layers.\1.attn_norm.\2"),
    (r"transformer\.h\.(\d+)\.attn\.c_proj\.(weight|bias)", r"model.layers.\1.attention.o_proj.\2"),
    (r"transformer\.h\.(\d+)\.ln_2\.(weight|bias)", r"model.layers.\1.mlp_norm.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_fc\.(weight|bias)", r"model.layers.\1.mlp.fc1.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_proj\.(weight|bias)", r"model.layers.\1.mlp.fc2.\2"),
    (r"transformer\.ln_f\.(weight|bias)", r"model.norm.\1"),
    (r"lm_head\.weight", "lm_head.weight"),
]
# Llama, Qwen2 and Mistral share their weight names; their projections are nn.Linear, (out, in) like ours.
_LLAMA_KEYS = [
    (r"model\.embed_tokens\.weight", "model.embed_tokens.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)", r"model.layers.\1.attention.\2_proj.\3"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.(weight|bias)", r"model.layers.\1.mlp.\2_proj.\3"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"model.layers.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"model.layers.\1.mlp_norm.weight"),
    (r"model\.norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]
_VIT_KEYS = [
    (r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"embeddings.patch_embeddings.\1"),
    (r"embeddings\.(cls_token|position_embeddings)", r"embeddings.\1"),
    (r"(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:attention\.)?(?:query|q_proj)\.(weight|bias)",
     r"layers.\1.attention.q_proj.\2"),
    (r"(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:attention\.)?(?:key|k_proj)\.(weight|bias)",
     r"layers.\1.attention.k_proj.\2"),
    (r"(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:attention\.)?(?:value|v_proj)\.(weight|bias)",
     r"layers.\1.attention.v_proj.\2"),
    (r"(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:output\.dense|o_proj)\.(weight|bias)",
     r"layers.\1.attention.o_proj.\2"),
    (r"(?:encoder\.layer|layers)\.(\d+)\.layernorm_before\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"(?:encoder\.layer|layers)\.(\d+)\.layernorm_after\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
    (r"(?:encoder\.layer|layers)\.(\d+)\.(?:intermediate\.dense|mlp\.fc1)\.(weight|bias)", r"layers.\1.mlp.fc1.\2"),
    (r"(?:encoder\.layer|layers)\.(\d+)\.(?:output\.dense|mlp\.fc2)\.(weight|bias)", r"layers.\1.mlp.fc2.\2"),
    (r"layernorm\.(weight|bias)", r"norm.\1"),
]


def _rename(state_dict, rules, prefix_in="", prefix_out=""):
    renamed = {}
    for key, tensor in state_dict.items():
        if not key.startswith(prefix_in):
            continue
        for pattern, target in rules:
            if re.fullmatch(pattern, key[len(prefix_in):]):
                renamed[prefix_out + re.sub(pattern, target, key[len(prefix_in):])] = tensor
                break
    return renamed


def _gpt2_config(src, overrides):
    unsupported = [name for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
                   if getattr(src, name, False)]
    if unsupported or not getattr(src, "scale_attn_weights", True):
        raise ValueError(f"GPT-2 settings without a p-LaT equivalent: {unsupported or ['scale_attn_weights=False']}")
    return PlatConfig(**{
        "vocab_size": src.vocab_size, "hidden_size": src.n_embd, "num_hidden_layers": src.n_layer,
        "num_attention_heads": src.n_head, "intermediate_size": src.n_inner or 4 * src.n_embd,
        "hidden_act": src.activation_function, "hidden_dropout_prob": src.resid_pdrop,
        "attention_probs_dropout_prob": src.attn_pdrop, "max_position_embeddings": src.n_positions,
        "layer_norm_eps": src.layer_norm_epsilon, "initializer_range": src.initializer_range,
        "tie_word_embeddings": src.tie_word_embeddings, "bos_token_id": src.bos_token_id,
        "eos_token_id": src.eos_token_id, "pad_token_id": src.pad_token_id, **overrides,
    })


# Source fields whose setting p-LaT cannot represent, when set to anything but "off" (None, False, 0).
_LLAMA_FAMILY_UNSUPPORTED = (
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "num_experts",
    "num_local_experts",
)


def _llama_config(src, overrides):
    """Llama, Qwen2 and Mistral: rotary positions, RMSNorm, gated MLP, grouped-query attention."""
    in_use = [f"{name}={getattr(src, name)!r}" for name in _LLAMA_FAMILY_UNSUPPORTED if getattr(src, name, None)]
    # One window for every layer (Mistral) converts; layers of different kinds (Qwen2's use_sliding_window from
    # max_window_layers on) do not.
    layer_types = set(getattr(src, "layer_types", None) or ())
    sliding_window = getattr(src, "sliding_window", None)
    if len(layer_types) > 1 or layer_types - {"full_attention", "sliding_attention"}:
        in_use.append(f"layer_types with {sorted(layer_types)}")
    elif layer_types == {"full_attention"}:
        sliding_window = None
    if in_use:
        raise ValueError(
            f"{type(src).__name__} settings without a p-LaT equivalent: {', '.join(in_use)} (sliding windows in some "
            "layers only, logit softcapping and mixtures of experts do not convert; a checkpoint only ever run on "
            "sequences shorter than its sliding_window converts after setting config.sliding_window = None)"
        )
    # Llama's attention_bias covers q, k, v and o; Qwen2 has q/k/v biases only; Mistral none.
    qkv_bias = src.model_type == "qwen2" or getattr(src, "attention_bias", False)
    return PlatConfig(**{
        "vocab_size": src.vocab_size, "hidden_size": src.hidden_size, "num_hidden_layers": src.num_hidden_layers,
        "num_attention_heads": src.num_attention_heads, "num_key_value_heads": src.num_key_value_heads,
        "head_dim": getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads,
        "intermediate_size": src.intermediate_size, "hidden_act": src.hidden_act, "mlp_type": "gated",
        "norm_type": "rmsnorm", "rms_norm_eps": src.rms_norm_eps, "position_embedding_type": "rope",
        "rope_parameters": dict(src.rope_parameters), "max_position_embeddings": src.max_position_embeddings,
        "sliding_window": sliding_window, "qkv_bias": qkv_bias, "o_proj_bias": getattr(src, "attention_bias", False),
        "mlp_bias": getattr(src, "mlp_bias", False), "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": src.attention_dropout, "initializer_range": src.initializer_range,
        "tie_word_embeddings": src.tie_word_embeddings, "bos_token_id": src.bos_token_id,
        "eos_token_id": src.eos_token_id, "pad_token_id": src.pad_token_id, **overrides,
    })


def _vit_config(src, overrides):
    for name in ("image_size", "patch_size"):
        if not isinstance(getattr(src, name), int):
            raise ValueError(f"Only square images and patches convert; the source has {name}={getattr(src, name)}")
    return PlatVisionConfig(**{
        "hidden_size": src.hidden_size, "num_hidden_layers": src.num_hidden_layers,
        "num_attention_heads": src.num_attention_heads, "intermediate_size": src.intermediate_size,
        "hidden_act": src.hidden_act, "hidden_dropout_prob": src.hidden_dropout_prob,
        "attention_probs_dropout_prob": src.attention_probs_dropout_prob, "layer_norm_eps": src.layer_norm_eps,
        "initializer_range": src.initializer_range, "qkv_bias": src.qkv_bias, "image_size": src.image_size,
        "patch_size": src.patch_size, "num_channels": src.num_channels, "id2label": src.id2label,
        "label2id": src.label2id, "problem_type": src.problem_type, **overrides,
    })


CONFIG_CONVERTERS = {
    "gpt2": _gpt2_config, "llama": _llama_config, "qwen2": _llama_config, "mistral": _llama_config, "vit": _vit_config,
}


def convertible(config):
    """True for the configs of the transformers models that ``convert_to_plat`` takes (GPT-2, Llama, Qwen2,
    Mistral, ViT)."""
    return config.model_type in CONFIG_CONVERTERS


def plat_config_for(source_config, plap_p=None, **overrides):
    """The p-LaT config of the same shapes as a transformers GPT-2, Llama, Qwen2, Mistral or ViT config (the paper's
    mix over the query heads by default); raises a ValueError naming any source setting p-LaT cannot represent."""
    if not convertible(source_config):
        raise ValueError(
            f"Cannot convert a {type(source_config).__name__} (model_type {source_config.model_type!r}): supported "
            "sources are GPT-2, Llama, Qwen2, Mistral and ViT (DeiT checkpoints without a distillation token, such "
            "as facebook/deit-tiny-patch16-224, are ViT ones)"
        )
    if plap_p is None and "plap_p" not in overrides:
        plap_p = paper_p_mix(source_config.num_attention_heads)
    if plap_p is not None:
        overrides = {**overrides, "plap_p": plap_p}
    return CONFIG_CONVERTERS[source_config.model_type](source_config, overrides)


def _gpt2_weights(model):
    source = model.state_dict()
    state = _rename(source, _GPT2_KEYS)
    hidden = model.config.n_embd
    for i in range(model.config.n_layer):
        prefix = f"transformer.h.{i}.attn.c_attn."
        for name, w, b in zip("qkv", source[prefix + "weight"].split(hidden, 1), source[prefix + "bias"].split(hidden)):
            state[f"model.layers.{i}.attention.{name}_proj.weight"] = w
            state[f"model.layers.{i}.attention.{name}_proj.bias"] = b
    conv1d = re.compile(r"model\.layers\.\d+\.(attention\.[qkvo]_proj|mlp\.fc[12])\.weight")
    return {k: v.t().contiguous() if conv1d.fullmatch(k) else v for k, v in state.items()}


def _llama_weights(model):
    return _rename(model.state_dict(), _LLAMA_KEYS)


def _vit_weights(model):
    source = model.state_dict()
    if type(model).__name__ == "ViTModel":
        return _rename(source, _VIT_KEYS)
    state = _rename(source, _VIT_KEYS, prefix_in="vit.", prefix_out="vit.")
    state.update({k: v for k, v in source.items() if k.startswith("classifier.")})
    return state


# Source class -> (p-LaT class, weight renaming).
TARGETS = {
    "GPT2LMHeadModel": (PlatForCausalLM, _gpt2_weights),
    "LlamaForCausalLM": (PlatForCausalLM, _llama_weights),
    "Qwen2ForCausalLM": (PlatForCausalLM, _llama_weights),
    "MistralForCausalLM": (PlatForCausalLM, _llama_weights),
    "ViTModel": (PlatVisionModel, _vit_weights),
    "ViTForImageClassification": (PlatForImageClassification, _vit_weights),
}


def convert_to_plat(model, plap_p=None, config=None, **config_overrides):
    """The p-LaT model with ``model``'s weights: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM,
    MistralForCausalLM, ViTModel or ViTForImageClassification.

    ``model`` may also be a path or hub id that ``AutoModel*.from_pretrained`` resolves. ``plap_p`` defaults to
    the paper's head mix; ``plap_p=2.0`` reproduces the source model's outputs. Other keyword arguments
    override PlatConfig fields (e.g. ``plap_formulation="euler"``); or pass the whole target ``config`` (as
    ``plat_config_for`` makes it). ViTModel's pooler has no p-LaT counterpart and is dropped
    (PlatVisionModel's pooler_output is the final [CLS] state).
    """
    if isinstance(model, str):
        model = _load_source(model)
    kind = type(model).__name__
    if kind not in TARGETS:
        raise ValueError(
            f"Cannot convert {kind}: supported sources are {', '.join(TARGETS)} "
            "(DeiT checkpoints without a distillation token, such as facebook/deit-tiny-patch16-224, are ViT ones)"
        )
    if config is None:
        config = plat_config_for(model.config, plap_p, **config_overrides)
    target_class, weights = TARGETS[kind]
    target, state = target_class(config), weights(model)
    expected = set(target.state_dict())
    tied = {"lm_head.weight"} if getattr(target.config, "tie_word_embeddings", False) else set()
    missing = expected - set(state) - tied
    if missing:
        raise ValueError(f"The {kind} checkpoint lacks weights for {sorted(missing)[:5]}")
    target.load_state_dict(state, strict=False)
    source = next(model.parameters())
    target = target.to(device=source.device, dtype=source.dtype)  # where and how the source computes
    return target.eval() if not model.training else target


def _load_source(name_or_path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

    architectures = AutoConfig.from_pretrained(name_or_path).architectures or []
    if any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in architectures):
        return AutoModelForCausalLM.from_pretrained(name_or_path)
    if any(a.endswith("ForImageClassification") for a in architectures):
        return AutoModelForImageClassification.from_pretrained(name_or_path)
    return AutoModel.from_pretrained(name_or_path)
