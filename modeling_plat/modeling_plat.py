"""p-Laplacian Transformer (p-LaT, arXiv 2311.03235) models: a causal LM (GPT-2-style, or Llama-style with rotary
positions, RMSNorm, a gated MLP and grouped-query attention, as its config says) and a ViT/DeiT-style classifier.

Reading order: norms and rotary positions -> attention -> MLPs -> layer -> pre-trained base -> text trunk and LM
head -> vision trunk and classifier. Both families share the layer; the config picks its pieces in ``__init__``;
only the mask (causal or not) and the embeddings differ between the families.
"""

import math

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    BaseModelOutputWithPooling,
    CausalLMOutputWithPast,
    ImageClassifierOutput,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, rotate_half
from transformers.utils import logging
from transformers.utils.generic import can_return_tuple

from .cache_name import CACHE_NAME, given_cache
from .configuration_plat import PlatConfig, PlatConfigBase, PlatVisionConfig
from .packing import packed_document_ids
from .plap_dispatch import layer_attention

logger = logging.get_logger(__name__)


def make_norm(config: PlatConfigBase):
    if config.norm_type == "rmsnorm":
        return LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class PlatRotaryEmbedding(nn.Module):
    """Rotary position angles of any of transformers' rotary types (``config.rope_parameters``): cos and sin of
    position * inv_freq, one angle per feature pair (i, i + rotary_dim / 2) of the first rotary_dim = head_dim *
    partial_rotary_factor features. transformers' rope functions compute inv_freq (and yarn's and longrope's
    attention_scaling); ``dynamic_rope_update`` recomputes it past the trained length (dynamic, longrope)."""

    def __init__(self, config: PlatConfig, device=None):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        # What dynamic_rope_update reads: the longest length of the current frequencies, and the trained one.
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        compute = ROPE_INIT_FUNCTIONS.get(self.rope_type, self.compute_default_rope_parameters)
        inv_freq, self.attention_scaling = compute(config, device)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, device=None, **kwargs):
        """(inv_freq = theta^(-2i / rotary_dim), attention scaling 1), as transformers' models define the default
        type for its rope functions' signature."""
        rotary_dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        return 1.0 / config.rope_parameters["rope_theta"] ** exponents, 1.0

    @dynamic_rope_update
    def forward(self, hidden_states, position_ids):
        """(cos, sin), each (B|1, N, rotary_dim) in ``hidden_states``' dtype; the angles in float32."""
        with torch.autocast(hidden_states.device.type, enabled=False):
            angles = position_ids[..., None].float() * self.inv_freq.float()  # (B|1, N, rotary_dim / 2)
            angles = torch.cat([angles, angles], dim=-1)  # (B|1, N, rotary_dim): the two halves share angles
            cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
            return cos.to(hidden_states.dtype), sin.to(hidden_states.dtype)


def apply_rotary(x, cos, sin):
    """Rotate each (i, i + r/2) feature pair of the first r = cos.shape[-1] features of (B, H, N, d) ``x`` by its
    position's angle, the others as they are (partial rotation); in ``x``'s dtype.

    Under autocast cos and sin are float32 like the residual stream while x (a projection) is half: the product
    would promote queries and keys to float32 beside half values.
    """
    rotary_dim = cos.shape[-1]
    rotated, kept = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos[:, None], sin[:, None]  # (B|1, 1, N, r): shared by all heads
    rotated = (rotated * cos + rotate_half(rotated) * sin).to(x.dtype)
    return torch.cat([rotated, kept], dim=-1) if kept.shape[-1] else rotated


class PlatAttention(nn.Module):
    """Multi-head p-Laplacian self-attention (eq. 12) with one exponent p per query head.

    With fewer key/value heads (grouped-query attention) the cache keeps those, and each is repeated for the query
    heads that read it: a query head's value distances D2 are those of its key/value head, its p its own.
    """

    def __init__(self, config: PlatConfigBase, layer_idx: int, is_causal: bool):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
        self.attn_dropout = config.attention_probs_dropout_prob
        # Static per head: no tensor to read on the host (compiled graphs stay whole), none for model.half() to round.
        self.p_values = tuple(config.p_per_layer()[layer_idx])

    def forward(self, hidden_states, attn_mask=None, cache=None, output_attentions=False,
                position_embeddings=None, document_ids=None):
        batch, length, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, H, N, d)
        key = self.k_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, N, d)
        value = self.v_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, N, d)
        if position_embeddings is not None:
            query, key = apply_rotary(query, *position_embeddings), apply_rotary(key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # (B, H_kv, T, d)
            if attn_mask is not None and attn_mask.shape[-1] > key.shape[-2]:
                attn_mask = attn_mask[..., -key.shape[-2] :]  # a sliding window's cache keeps the last keys only
        window = getattr(self.config, "sliding_window", None) if self.is_causal else None  # the text family's
        attn_output, weights = layer_attention(
            query, key, value, p=self.p_values, attn_mask=attn_mask, is_causal=self.is_causal, sliding_window=window,
            document_ids=document_ids, eps=self.config.plap_eps, formulation=self.config.plap_formulation,
            backend=self.config.plap_backend, dropout=self.attn_dropout if self.training else 0.0,
            output_attentions=output_attentions,
        )  # (B, H, N, d)
        attn_output = attn_output.transpose(1, 2).reshape(batch, length, -1)  # (B, N, H * d)
        return self.o_proj(attn_output), weights


class PlatMLP(nn.Module):
    """GPT-2 / ViT MLP: fc2(act(fc1(x)))."""

    def __init__(self, config: PlatConfigBase):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden_states):
        return self.fc2(self.act(self.fc1(hidden_states)))


# "gated": Llama's SwiGLU (with hidden_act="silu"), down_proj(act(gate_proj(x)) * up_proj(x)).
MLPS = {"plain": PlatMLP, "gated": LlamaMLP}


class PlatLayer(GradientCheckpointingLayer):
    """Pre-norm transformer block: x + Attn(Norm(x)), then x + MLP(Norm(x))."""

    def __init__(self, config: PlatConfigBase, layer_idx: int, is_causal: bool):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attention = PlatAttention(config, layer_idx, is_causal)
        self.mlp_norm = make_norm(config)
        self.mlp = MLPS[config.mlp_type](config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attn_mask=None, cache=None, output_attentions=False,
                position_embeddings=None, document_ids=None):
        attn_output, weights = self.attention(
            self.attn_norm(hidden_states), attn_mask, cache, output_attentions, position_embeddings,
            document_ids,
        )
        hidden_states = hidden_states + self.dropout(attn_output)
        hidden_states = hidden_states + self.dropout(self.mlp(self.mlp_norm(hidden_states)))
        return hidden_states, weights


def run_layers(layers, hidden_states, attn_mask, cache, output_attentions, output_hidden_states,
               position_embeddings=None, document_ids=None):
    """The stack of blocks shared by both trunks; collects hidden states and weights when asked."""
    all_hidden_states = (hidden_states,) if output_hidden_states else None
    all_attentions = () if output_attentions else None
    for layer in layers:
        hidden_states, weights = layer(
            hidden_states, attn_mask=attn_mask, cache=cache, output_attentions=output_attentions,
            position_embeddings=position_embeddings, document_ids=document_ids,
        )
        if output_attentions:
            all_attentions += (weights,)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
    return hidden_states, all_hidden_states, all_attentions


class PlatPreTrainedModel(PreTrainedModel):
    """Weights init, loading and saving shared by both p-LaT families; the text family's base class."""

    config_class = PlatConfig
    config: PlatConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["PlatLayer", "PlatVisionEmbeddings"]
    _skip_keys_device_placement = [CACHE_NAME]
    # p-LaT attention is chosen by config.plap_backend, which is saved with the model; attn_implementation is
    # not, and a reloaded model must never fall back to softmax attention.
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    # Auto classes a saved checkpoint names in auto_map for remote code: the trunk and the head of its family
    # (transformers writes only the saved class's own entry).
    _family_auto_map = {"AutoModel": "modeling_plat.PlatModel", "AutoModelForCausalLM": "modeling_plat.PlatForCausalLM"}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            # Raised before any weight is assigned: no half-loaded model escapes.
            raise OSError(
                f"The weights in {pretrained_model_name_or_path} are truncated or corrupt ({error}); "
                "re-download or re-save the checkpoint"
            ) from error

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **self._family_auto_map}
        return super().save_pretrained(save_directory, *args, **kwargs)

    @staticmethod
    def _refuse_attn_implementation(requested):
        if requested not in (None, "eager"):
            raise ValueError(
                f"attn_implementation={requested!r}: p-LaT models have one attention, the p-Laplacian one, and the "
                "config's plap_backend (saved with the model) chooses how to compute it, e.g. "
                "from_pretrained(..., plap_backend='tiled'); attn_implementation can only be 'eager'."
            )

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        # transformers' hook for attn_implementation in from_pretrained / from_config / __init__.
        self._refuse_attn_implementation(attn_implementation)
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        # transformers would only log that this model cannot switch, and return.
        requested = attn_implementation.get("") if isinstance(attn_implementation, dict) else attn_implementation
        self._refuse_attn_implementation(requested)
        return super().set_attn_implementation(attn_implementation, *args, **kwargs)

    def _validate_generated_length(self, generation_config, input_ids_length, *args, **kwargs):
        """Refuse before generating what learned positions cannot reach, rather than fail at that token and lose
        the ones generated before it."""
        super()._validate_generated_length(generation_config, input_ids_length, *args, **kwargs)
        limit = self.config.max_position_embeddings
        learned = getattr(self.config, "position_embedding_type", "learned") == "learned"
        if learned and generation_config.max_length > limit:
            raise ValueError(
                f"Generating up to {generation_config.max_length} tokens ({input_ids_length} in the prompt), but this "
                f"model has learned positions for {limit} (max_position_embeddings): ask for at most "
                f"{max(limit - input_ids_length, 0)} new tokens (max_new_tokens) or shorten the prompt."
            )

    @torch.no_grad()
    def _init_weights(self, module):
        """GPT-2 / ViT init: N(0, initializer_range), residual projections scaled by 1 / sqrt(2 * layers)."""
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, PlatAttention):
            init.normal_(module.o_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, PlatMLP):
            init.normal_(module.fc2.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, LlamaMLP):
            init.normal_(module.down_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))
        elif isinstance(module, PlatVisionEmbeddings):
            init.trunc_normal_(module.position_embeddings, mean=0.0, std=std)
            init.trunc_normal_(module.cls_token, mean=0.0, std=std)


def _check_range(name, tensor, low, high, hint):
    """Clear error for indices outside [low, high); ``hint`` is a string or a function that makes one (formatting
    sizes into a message ahead of time would fix symbolic sizes under torch.compile).

    Only for CPU tensors outside compilation: reading a GPU tensor's values would synchronise the host on every
    forward (every generated token), and a compiled graph cannot branch on values.
    """
    if tensor.device.type != "cpu" or torch.compiler.is_compiling() or tensor.numel() == 0:
        return
    lowest, highest = int(tensor.min()), int(tensor.max())
    if lowest < low or highest >= high:
        hint = hint() if callable(hint) else hint
        raise ValueError(f"{name} must lie in [{low}, {high - 1}] ({hint}); got values in [{lowest}, {highest}]")


class PlatModel(PlatPreTrainedModel):
    """Decoder-only p-LaT trunk: token embeddings, learned (GPT-2) or rotary (Llama) positions, causal pre-norm
    blocks, a final norm."""

    def __init__(self, config: PlatConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        learned = config.position_embedding_type == "learned"
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size) if learned else None
        self.rotary_emb = None if learned else PlatRotaryEmbedding(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.layers = nn.ModuleList(PlatLayer(config, i, is_causal=True) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _check_text_inputs(self, input_ids, inputs_embeds, attention_mask, cache):
        """Raise a ValueError naming the input for ids, embeddings, a mask or a cache the model cannot read."""
        if cache is not None and cache.is_compileable:
            # A static cache hands back its whole fixed length, empty slots included, and p-LaT's attention
            # aligns queries with the last cached keys.
            raise ValueError(
                "p-LaT needs a DynamicCache: a static (fixed-size) cache such as generate(cache_implementation="
                "'static') is not supported"
            )
        past_length = cache.get_seq_length() if cache is not None else 0
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (batch, length); got shape {tuple(input_ids.shape)}")
            _check_range("input_ids", input_ids, 0, self.config.vocab_size, "vocab_size")
            batch, length = input_ids.shape
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(
                    f"inputs_embeds must be (batch, length, {self.config.hidden_size}); "
                    f"got {tuple(inputs_embeds.shape)}"
                )
            batch, length = inputs_embeds.shape[:2]
        if length == 0:
            raise ValueError("Empty input: the sequence length is 0")
        if attention_mask is not None and attention_mask.shape != (batch, past_length + length):
            raise ValueError(
                f"attention_mask must have shape (batch, past + new tokens) = {(batch, past_length + length)}; "
                f"got {tuple(attention_mask.shape)}"
            )

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """
        input_ids (`torch.LongTensor` of shape `(B, N)`) or inputs_embeds (`(B, N, hidden_size)`): the new tokens.
        attention_mask (`(B, past + N)`, 1 = real token, 0 = padding): left or right padding.
        position_ids (`(B, N)`): defaults to the count of real tokens before each one, so left padding
            gives the same logits as no padding. Positions that restart at 0 after a real token mark packed
            documents (transformers' `DataCollatorWithFlattening`), as do `cu_seq_lens_q` / `cu_seq_lens_k`
            among the keyword arguments: each document then attends only within itself, and no cache is kept.
        cache (a `DynamicCache`; `past_key_values` before transformers 5.24, either name is read): the keys and
            values of the tokens before these.
        """
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = given_cache(cache, past_key_values)
        if self.gradient_checkpointing and self.training and (use_cache or cache is not None):
            # the backward pass recomputes each layer, which would append its keys and values to the cache again
            if cache is not None:
                logger.warning_once("A cache is incompatible with gradient checkpointing: it is dropped.")
            use_cache, cache = False, None
        self._check_text_inputs(input_ids, inputs_embeds, attention_mask, cache)
        batch, length = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        documents = packed_document_ids(
            position_ids, attention_mask, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), batch=batch,
            length=length, cache_given=cache is not None,
        )  # fmt: skip
        use_cache = use_cache and documents is None  # a cache of packed rows would attend across documents
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past_length = cache.get_seq_length() if cache is not None else 0
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        length = inputs_embeds.shape[1]

        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, past_length:]  # (B, N)
            else:
                position_ids = torch.arange(past_length, past_length + length, device=inputs_embeds.device)[None]

        hidden_states, position_embeddings = inputs_embeds, None
        if self.embed_positions is not None:
            _check_range(
                "position_ids", position_ids, 0, self.config.max_position_embeddings,
                lambda: f"the sequence (past {past_length} + new {length} tokens) may not be longer than "
                "max_position_embeddings",
            )
            hidden_states = hidden_states + self.embed_positions(position_ids)
        else:
            position_embeddings = self.rotary_emb(hidden_states, position_ids)  # (cos, sin), each (B|1, N, d)
        hidden_states = self.dropout(hidden_states)
        attn_mask = attention_mask[:, None, None, :] if attention_mask is not None else None  # (B, 1, 1, T)
        hidden_states, all_hidden_states, all_attentions = run_layers(
            self.layers, hidden_states, attn_mask, cache, output_attentions, output_hidden_states,
            position_embeddings, documents,
        )
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            **{CACHE_NAME: cache if use_cache else None},
        )


class PlatForCausalLM(PlatPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: PlatConfig):
        super().__init__(config)
        self.model = PlatModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """
        labels (`(B, N)`): next-token targets aligned with the inputs (shifted inside); -100 is ignored.
        logits_to_keep: compute logits for the last this many positions only (0 = all).
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            past_key_values=past_key_values,
            return_dict=True,
            **kwargs,  # cu_seq_lens_q / cu_seq_lens_k of packed rows
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            if labels.shape != hidden_states.shape[:2]:
                raise ValueError(
                    f"labels must have the shape of the inputs {tuple(hidden_states.shape[:2])}; "
                    f"got {tuple(labels.shape)}"
                )
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )


class PlatVisionEmbeddings(nn.Module):
    """ViT embeddings: non-overlapping patches by a strided convolution, a [CLS] token, learned positions."""

    def __init__(self, config: PlatVisionConfig):
        super().__init__()
        self.patch_size = config.patch_size
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.patch_embeddings = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.position_embeddings = nn.Parameter(torch.zeros(1, self.num_patches + 1, config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def interpolate_pos_encoding(self, height, width):
        """Bicubic resize of the patch position grid to (height, width) patches; the [CLS] position is kept."""
        if height * width == self.num_patches and height == width:
            return self.position_embeddings
        cls_pos, patch_pos = self.position_embeddings[:, :1], self.position_embeddings[:, 1:]
        side = int(math.sqrt(self.num_patches))
        grid = patch_pos.reshape(1, side, side, -1).permute(0, 3, 1, 2)  # (1, D, side, side)
        grid = nn.functional.interpolate(grid, size=(height, width), mode="bicubic", align_corners=False)
        patch_pos = grid.permute(0, 2, 3, 1).reshape(1, height * width, -1)  # (1, h * w, D)
        return torch.cat([cls_pos, patch_pos], dim=1)

    def forward(self, pixel_values, interpolate_pos_encoding=False):
        patches = self.patch_embeddings(pixel_values)  # (B, D, h, w)
        height, width = patches.shape[-2:]
        patches = patches.flatten(2).transpose(1, 2)  # (B, h * w, D)
        cls = self.cls_token.expand(patches.shape[0], -1, -1)  # (B, 1, D)
        embeddings = torch.cat([cls, patches], dim=1)  # (B, 1 + h * w, D)
        if interpolate_pos_encoding:
            embeddings = embeddings + self.interpolate_pos_encoding(height, width)
        else:
            embeddings = embeddings + self.position_embeddings
        return self.dropout(embeddings)


class PlatVisionPreTrainedModel(PlatPreTrainedModel):
    """The vision family's base class: its own config type, so that AutoModel maps it to the vision trunk."""

    config_class = PlatVisionConfig
    config: PlatVisionConfig
    base_model_prefix = "vit"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    _family_auto_map = {
        "AutoModel": "modeling_plat.PlatVisionModel",
        "AutoModelForImageClassification": "modeling_plat.PlatForImageClassification",
    }


class PlatVisionModel(PlatVisionPreTrainedModel):
    """ViT/DeiT-style p-LaT trunk: patch embeddings, bidirectional pre-LN blocks, final LayerNorm."""

    def __init__(self, config: PlatVisionConfig):
        super().__init__(config)
        self.embeddings = PlatVisionEmbeddings(config)
        self.layers = nn.ModuleList(PlatLayer(config, i, is_causal=False) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.patch_embeddings

    def _check_pixel_values(self, pixel_values, interpolate_pos_encoding):
        config = self.config
        if pixel_values is None or pixel_values.dim() != 4:
            shape = None if pixel_values is None else tuple(pixel_values.shape)
            raise ValueError(f"pixel_values must be (batch, {config.num_channels}, height, width); got {shape}")
        batch, channels, height, width = pixel_values.shape
        if batch == 0:
            raise ValueError("Empty batch: pixel_values has batch size 0")
        if channels != config.num_channels:
            raise ValueError(
                f"pixel_values has {channels} channels but the model expects num_channels={config.num_channels}"
            )
        if interpolate_pos_encoding:
            if height % config.patch_size or width % config.patch_size:
                raise ValueError(
                    f"With interpolate_pos_encoding, height and width must be multiples of patch_size "
                    f"{config.patch_size}; got {height}x{width}"
                )
        elif (height, width) != (config.image_size, config.image_size):
            raise ValueError(
                f"pixel_values are {height}x{width} but the model expects {config.image_size}x{config.image_size}; "
                "resize them, or pass interpolate_pos_encoding=True"
            )

    @can_return_tuple
    def forward(
        self,
        pixel_values=None,
        output_attentions=None,
        output_hidden_states=None,
        interpolate_pos_encoding=False,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        self._check_pixel_values(pixel_values, interpolate_pos_encoding)
        pixel_values = pixel_values.to(self.embeddings.patch_embeddings.weight.dtype)
        hidden_states = self.embeddings(pixel_values, interpolate_pos_encoding)
        hidden_states, all_hidden_states, all_attentions = run_layers(
            self.layers, hidden_states, None, None, output_attentions, output_hidden_states
        )
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        return BaseModelOutputWithPooling(
            last_hidden_state=hidden_states,
            pooler_output=hidden_states[:, 0],
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )


class PlatForImageClassification(PlatVisionPreTrainedModel):
    """p-LaT vision transformer with a linear classifier on the final [CLS] token."""

    def __init__(self, config: PlatVisionConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = PlatVisionModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        pixel_values=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        interpolate_pos_encoding=False,
        **kwargs,
    ) -> ImageClassifierOutput:
        """
        labels (`(B,)` class indices, `(B, num_labels)` multi-hot floats, or `(B,)` / `(B, num_labels)` regression
            targets): the loss follows `config.problem_type` (inferred when unset, as in transformers).
        """
        outputs = self.vit(
            pixel_values,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            interpolate_pos_encoding=interpolate_pos_encoding,
            return_dict=True,
        )
        logits = self.classifier(outputs.pooler_output)  # (B, num_labels)
        loss = None
        if labels is not None:
            self._check_labels(labels, logits)
            loss = self.loss_function(labels, logits, self.config, **kwargs)
        return ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )

    def _check_labels(self, labels, logits):
        batch = logits.shape[0]
        if labels.shape[0] != batch:
            raise ValueError(f"labels has batch size {labels.shape[0]} but pixel_values has {batch}")
        integer = not labels.is_floating_point()
        if integer and self.config.problem_type in (None, "single_label_classification") and self.num_labels > 1:
            if labels.dim() != 1:
                raise ValueError(f"Class-index labels must be (batch,); got shape {tuple(labels.shape)}")
            _check_range("labels", labels, 0, self.num_labels, "num_labels")
        if self.config.problem_type == "multi_label_classification" and labels.shape != logits.shape:
            raise ValueError(
                f"Multi-label labels must be (batch, num_labels) = {tuple(logits.shape)}; got {tuple(labels.shape)}"
            )


__all__ = [
    "PlatPreTrainedModel",
    "PlatVisionPreTrainedModel",
    "PlatModel",
    "PlatForCausalLM",
    "PlatVisionModel",
    "PlatForImageClassification",
]

PlatConfig.register_for_auto_class()
PlatVisionConfig.register_for_auto_class()
PlatModel.register_for_auto_class("AutoModel")
PlatForCausalLM.register_for_auto_class("AutoModelForCausalLM")
PlatVisionModel.register_for_auto_class("AutoModel")
PlatForImageClassification.register_for_auto_class("AutoModelForImageClassification")
# Trainer shifts the labels of its label smoothing (--label_smoothing_factor) only for the causal language models that
# transformers lists by class name, which AutoModelForCausalLM.register does not extend: unlisted, each position's
# logits were scored against its own token. Listed here, not in __init__, so that remote code lists it as well.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(PlatConfig.model_type, PlatForCausalLM.__name__)
