"""Turn a transformers GPT-2 or ViT checkpoint into the equivalent p-LaT model.

p-LaT adds no parameters: the weights carry over unchanged and only the attention rule changes. With
``plap_p=2.0`` the converted model computes exactly what the source model does.
"""

import re
import sys

from .configuration_plat import PlatConfig, paper_p_mix
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


def _gpt2(model, plap_p, overrides):
    src = model.config
    unsupported = [name for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
                   if getattr(src, name, False)]
    if unsupported or not getattr(src, "scale_attn_weights", True):
        raise ValueError(f"GPT-2 settings without a p-LaT equivalent: {unsupported or ['scale_attn_weights=False']}")
    config = PlatConfig(
        vocab_size=src.vocab_size, hidden_size=src.n_embd, num_hidden_layers=src.n_layer,
        num_attention_heads=src.n_head, intermediate_size=src.n_inner or 4 * src.n_embd,
        hidden_act=src.activation_function, hidden_dropout_prob=src.resid_pdrop,
        attention_probs_dropout_prob=src.attn_pdrop, max_position_embeddings=src.n_positions,
        layer_norm_eps=src.layer_norm_epsilon, initializer_range=src.initializer_range,
        tie_word_embeddings=src.tie_word_embeddings, bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id,
        plap_p=paper_p_mix(src.n_head) if plap_p is None else plap_p, **overrides,
    )
    source = model.state_dict()
    state = _rename(source, _GPT2_KEYS)
    hidden = src.n_embd
    for i in range(src.n_layer):
        prefix = f"transformer.h.{i}.attn.c_attn."
        for name, w, b in zip("qkv", source[prefix + "weight"].split(hidden, 1), source[prefix + "bias"].split(hidden)):
            state[f"model.layers.{i}.attention.{name}_proj.weight"] = w
            state[f"model.layers.{i}.attention.{name}_proj.bias"] = b
    conv1d = re.compile(r"model\.layers\.\d+\.(attention\.[qkvo]_proj|mlp\.fc[12])\.weight")
    state = {k: v.t().contiguous() if conv1d.fullmatch(k) else v for k, v in state.items()}
    return PlatForCausalLM(config), state


def _vit(model, plap_p, overrides, with_head):
    src = model.config
    for name in ("image_size", "patch_size"):
        if not isinstance(getattr(src, name), int):
            raise ValueError(f"Only square images and patches convert; the source has {name}={getattr(src, name)}")
    config = PlatConfig(
        hidden_size=src.hidden_size, num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads, intermediate_size=src.intermediate_size,
        hidden_act=src.hidden_act, hidden_dropout_prob=src.hidden_dropout_prob,
        attention_probs_dropout_prob=src.attention_probs_dropout_prob, layer_norm_eps=src.layer_norm_eps,
        initializer_range=src.initializer_range, qkv_bias=src.qkv_bias, image_size=src.image_size,
        patch_size=src.patch_size, num_channels=src.num_channels, id2label=src.id2label, label2id=src.label2id,
        problem_type=src.problem_type, plap_p=paper_p_mix(src.num_attention_heads) if plap_p is None else plap_p,
        **overrides,
    )
    source = model.state_dict()
    if with_head:
        state = _rename(source, _VIT_KEYS, prefix_in="vit.", prefix_out="vit.")
        state.update({k: v for k, v in source.items() if k.startswith("classifier.")})
        return PlatForImageClassification(config), state
    return PlatVisionModel(config), _rename(source, _VIT_KEYS)


def convert_to_plat(model, plap_p=None, **config_overrides):
    """The p-LaT model with ``model``'s weights: GPT2LMHeadModel, ViTModel or ViTForImageClassification.

    ``model`` may also be a path or hub id that ``AutoModel*.from_pretrained`` resolves. ``plap_p`` defaults to
    the paper's head mix; ``plap_p=2.0`` reproduces the source model's outputs. Other keyword arguments
    override PlatConfig fields (e.g. ``plap_formulation="euler"``). ViTModel's pooler has no p-LaT
    counterpart and is dropped (PlatVisionModel's pooler_output is the final [CLS] state).
    """
    if isinstance(model, str):
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

        architectures = AutoConfig.from_pretrained(model).architectures or []
        if any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in architectures):
            model = AutoModelForCausalLM.from_pretrained(model)
        elif any(a.endswith("ForImageClassification") for a in architectures):
            model = AutoModelForImageClassification.from_pretrained(model)
        else:
            model = AutoModel.from_pretrained(model)

    kind = type(model).__name__
    if kind == "GPT2LMHeadModel":
        target, state = _gpt2(model, plap_p, config_overrides)
    elif kind in ("ViTModel", "ViTForImageClassification"):
        target, state = _vit(model, plap_p, config_overrides, with_head=kind == "ViTForImageClassification")
    else:
        raise ValueError(
            f"Cannot convert {kind}: supported sources are GPT2LMHeadModel, ViTModel and ViTForImageClassification "
            "(DeiT checkpoints without a distillation token, such as facebook/deit-tiny-patch16-224, are ViT ones)"
        )
    expected = set(target.state_dict())
    missing = expected - set(state) - ({"lm_head.weight"} if target.config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"The {kind} checkpoint lacks weights for {sorted(missing)[:5]}")
    target.load_state_dict(state, strict=False)
    dtype = next(model.parameters()).dtype
    return target.to(dtype).eval() if not model.training else target.to(dtype)


def _parse_p(text):
    """``2.0`` -> 2.0; ``1.5,1.5,2.5`` -> per-head list; ``[[...],[...]]`` (JSON) -> per-layer lists."""
    import json

    try:
        value = json.loads(text if text.lstrip().startswith("[") else f"[{text}]")
    except json.JSONDecodeError:
        raise ValueError(f"--plap_p must be a number, a comma-separated list or a JSON list of lists; got {text!r}")
    return value[0] if len(value) == 1 and not isinstance(value[0], list) else value


def main(argv=None):
    """Command line: convert a GPT-2 / ViT checkpoint and save it with its tokenizer or image processor."""
    import argparse

    from transformers import AutoImageProcessor, AutoTokenizer

    from plat_train.model_card import current_command, write_model_card

    parser = argparse.ArgumentParser(prog="python -m modeling_plat.convert", description=convert_to_plat.__doc__)
    parser.add_argument("--source", required=True, help="path or hub id of a GPT-2 or ViT checkpoint")
    parser.add_argument("--output", required=True, help="folder to save the p-LaT checkpoint in")
    parser.add_argument("--plap_p", type=_parse_p, default=None, help="e.g. 1.5,1.5,2.5 (default: the paper's mix)")
    parser.add_argument("--plap_formulation", choices=["paper", "euler"], default="paper")
    parser.add_argument("--plap_eps", type=float, default=1e-6)
    args = parser.parse_args(argv)

    model = convert_to_plat(args.source, plap_p=args.plap_p, plap_formulation=args.plap_formulation,
                            plap_eps=args.plap_eps)
    model.save_pretrained(args.output)
    text = isinstance(model, PlatForCausalLM)
    processor_class = AutoTokenizer if text else AutoImageProcessor
    try:
        processor_class.from_pretrained(args.source).save_pretrained(args.output)
    except (OSError, ValueError) as error:
        print(f"No {processor_class.__name__[4:]} copied from {args.source}: {error}", file=sys.stderr)
    write_model_card(args.output, model.config, "text-generation" if text else "image-classification",
                     base_model=args.source, command=current_command())
    print(f"Saved p-LaT {type(model).__name__} (p per head: {model.config.p_per_layer()[0]}) to {args.output}")


if __name__ == "__main__":
    main()
