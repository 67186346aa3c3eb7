"""Configurations of the p-LaT families: ``PlatConfig`` (language model, ``"plat"``) and ``PlatVisionConfig``
(vision transformer, ``"plat_vision"``).

One config type per family, as transformers does for its own text / vision pairs: ``AutoModel`` maps a config
class to exactly one trunk, so a vision checkpoint must not share the text family's config type.
"""

import math

from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import logging

from .cache_name import CACHE_NAME
from .plap_dispatch import BACKENDS, FORMULATIONS

logger = logging.get_logger(__name__)

# Bumped when a saved config means something different to this code; older configs stay loadable.
PLAT_CONFIG_VERSION = 1
NORM_TYPES = ("layernorm", "rmsnorm")
MLP_TYPES = ("plain", "gated")
POSITION_EMBEDDING_TYPES = ("learned", "rope")
# transformers' rotary types: its models' default one and those of its rope functions (linear, dynamic, yarn, ...).
ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)


def _follows(name, default):
    """A config field that reads as ``default(config)`` while unset (None), as transformers' configs resolve it (their
    cache, generation and rotary code read it), and follows the fields it derives from when they change later (a
    preset with --config_overrides); config.json keeps what was given."""

    def get(self):
        given = self.__dict__.get(name)
        return default(self) if given is None else given

    def set(self, value):
        self.__dict__[name] = value

    return property(get, set)


def paper_p_mix(num_heads):
    """The paper's head mix: the first ceil(H / 2) heads with p = 1.5, the others with p = 2.5."""
    num_low = (num_heads + 1) // 2
    return [1.5] * num_low + [2.5] * (num_heads - num_low)


class PlatConfigBase(PretrainedConfig):
    r"""The transformer and p-Laplacian fields that both p-LaT families share; not a model type of its own.

    Args:
        hidden_size (`int`, defaults to 128): width of the residual stream.
        num_hidden_layers (`int`, defaults to 4): number of transformer blocks.
        num_attention_heads (`int`, defaults to 8): heads per block; must divide `hidden_size`.
        intermediate_size (`int`, defaults to 4 * hidden_size): MLP width.
        num_key_value_heads (`int`, defaults to num_attention_heads): key/value heads (grouped-query attention when
            fewer); each serves num_attention_heads / num_key_value_heads consecutive query heads.
        head_dim (`int`, defaults to hidden_size / num_attention_heads): width of each query, key and value head.
        hidden_act (`str`, defaults to `"gelu"`): MLP activation (any key of `transformers.activations.ACT2FN`).
        mlp_type (`str`, defaults to `"plain"`): `"plain"` (fc1 -> act -> fc2, GPT-2 / ViT) or `"gated"`
            (down_proj(act(gate_proj(x)) * up_proj(x)), Llama's SwiGLU with `hidden_act="silu"`).
        norm_type (`str`, defaults to `"layernorm"`): `"layernorm"` (`layer_norm_eps`) or `"rmsnorm"` (`rms_norm_eps`).
        hidden_dropout_prob (`float`, defaults to 0.0): dropout on embeddings and residual branches.
        attention_probs_dropout_prob (`float`, defaults to 0.0): dropout on the effective attention weights.
        layer_norm_eps (`float`, defaults to 1e-5): LayerNorm epsilon.
        rms_norm_eps (`float`, defaults to 1e-6): RMSNorm epsilon.
        initializer_range (`float`, defaults to 0.02): std of the normal weight init.
        qkv_bias (`bool`, defaults to `True`): biases on the query, key and value projections.
        o_proj_bias (`bool`, defaults to `True`): bias on the attention output projection.
        attention_bias (`bool`, optional): transformers' (Llama's) name for both of the above at once; reading it
            gives their common value, or None where they differ (Qwen2: q/k/v biases only).
        mlp_bias (`bool`, defaults to `True`): biases on the MLP projections.
        plap_p (`float`, `list[float]` or `list[list[float]]`, defaults to the paper's mix): the exponent p,
            one for all heads, one per head (shared by all layers) or one per layer and head. `p = 2` is
            softmax attention. The default is the paper's mix: ceil(H / 2) heads with p = 1.5, the rest 2.5.
        plap_eps (`float`, defaults to 1e-6): added to squared value distances before the power.
        plap_formulation (`str`, defaults to `"paper"`): `"paper"` (eq. 12) or `"euler"` (exact Euler step
            of the gradient flow, no self-weight singularity); `"noself"` and `"selfweight"` split eq. 12 into
            its weighting of the other tokens and its self-weight (the eager backend runs them).
        plap_backend (`str`, defaults to `"auto"`): attention kernel, see `modeling_plat.plap_dispatch.BACKENDS`.
        plat_config_version (`int`): format version of this config; a newer one than the code knows is refused.
    """

    # Integer fields of the family that must be positive (checked with the shared ones).
    family_sizes = ()
    num_key_value_heads = _follows("num_key_value_heads", lambda config: config.num_attention_heads)
    head_dim = _follows("head_dim", lambda config: config.hidden_size // config.num_attention_heads)

    def __init__(
        self,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=None,
        head_dim=None,
        intermediate_size=None,
        hidden_act="gelu",
        mlp_type="plain",
        norm_type="layernorm",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        layer_norm_eps=1e-5,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        qkv_bias=True,
        o_proj_bias=True,
        mlp_bias=True,
        attention_bias=None,
        plap_p=None,
        plap_eps=1e-6,
        plap_formulation="paper",
        plap_backend="auto",
        plat_config_version=PLAT_CONFIG_VERSION,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.intermediate_size = 4 * hidden_size if intermediate_size is None else intermediate_size
        self.hidden_act = hidden_act
        self.mlp_type = mlp_type
        self.norm_type = norm_type
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.layer_norm_eps = layer_norm_eps
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.qkv_bias = qkv_bias
        self.o_proj_bias = o_proj_bias
        self.mlp_bias = mlp_bias
        if attention_bias is not None:
            self.attention_bias = attention_bias
        self.plap_p = paper_p_mix(num_attention_heads) if plap_p is None else plap_p
        self.plap_eps = plap_eps
        self.plap_formulation = plap_formulation
        self.plap_backend = plap_backend
        self.plat_config_version = plat_config_version
        super().__init__(**kwargs)
        self.validate_plat()

    def validate_plat(self):
        """Raise a ValueError naming the field for any inconsistent p-LaT or shape setting."""
        if not isinstance(self.plat_config_version, int) or self.plat_config_version > PLAT_CONFIG_VERSION:
            raise ValueError(
                f"This config has plat_config_version={self.plat_config_version!r}, written by a newer plat than "
                f"this one (which reads up to {PLAT_CONFIG_VERSION}); upgrade plat or load it with trust_remote_code=True"
            )
        given = [name for name in ("num_key_value_heads", "head_dim") if self.__dict__.get(name) is not None]
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", *given, "intermediate_size",
                     *self.family_sizes):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if "head_dim" not in given and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}), or head_dim given"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        for name, value, allowed in (("norm_type", self.norm_type, NORM_TYPES), ("mlp_type", self.mlp_type, MLP_TYPES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}; got {value!r}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act must be one of transformers' activations (ACT2FN); got {self.hidden_act!r}")
        if not (isinstance(self.plap_eps, (int, float)) and math.isfinite(self.plap_eps) and self.plap_eps > 0):
            raise ValueError(f"plap_eps must be a finite number > 0; got {self.plap_eps!r}")
        if self.plap_formulation not in FORMULATIONS:
            raise ValueError(f"plap_formulation must be one of {FORMULATIONS}; got {self.plap_formulation!r}")
        if self.plap_backend not in BACKENDS:
            raise ValueError(f"plap_backend must be one of {BACKENDS}; got {self.plap_backend!r}")
        self.p_per_layer()  # validates plap_p

    @property
    def attention_bias(self):
        return self.qkv_bias if self.qkv_bias == self.o_proj_bias else None

    @attention_bias.setter
    def attention_bias(self, value):
        if not isinstance(value, bool):
            raise ValueError(f"attention_bias must be True or False; got {value!r}")
        self.qkv_bias = self.o_proj_bias = value

    def head_shape(self):
        """(num_key_value_heads, head_dim)."""
        return self.num_key_value_heads, self.head_dim

    def p_per_layer(self):
        """plap_p expanded to a (num_hidden_layers x num_attention_heads) list of lists of floats."""
        layers, heads, p = self.num_hidden_layers, self.num_attention_heads, self.plap_p
        if isinstance(p, (int, float)) and not isinstance(p, bool):
            table = [[p] * heads] * layers
        elif isinstance(p, (list, tuple)) and p and all(isinstance(row, (list, tuple)) for row in p):
            if len(p) != layers or any(len(row) != heads for row in p):
                raise ValueError(
                    f"plap_p as a list of lists needs {layers} rows (num_hidden_layers) of {heads} values "
                    f"(num_attention_heads); got {[len(row) for row in p]} values per row"
                )
            table = [list(row) for row in p]
        elif isinstance(p, (list, tuple)):
            if len(p) != heads:
                raise ValueError(
                    f"plap_p as a list needs one value per head ({heads} = num_attention_heads); got {len(p)}"
                )
            table = [list(p)] * layers
        else:
            raise ValueError(f"plap_p must be a number, a list per head or a list per layer of lists; got {p!r}")
        for row in table:
            for value in row:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"plap_p values must be finite numbers; got {value!r}")
                if value < 1:
                    raise ValueError(f"plap_p values must be >= 1 (p < 1 is not a p-Laplacian); got {value}")
        return [[float(v) for v in row] for row in table]


class PlatConfig(PlatConfigBase):
    r"""Configuration of a p-LaT language model (`PlatModel`, `PlatForCausalLM`): GPT-2-style by default, Llama-style
    with `position_embedding_type="rope"`, `norm_type="rmsnorm"`, `mlp_type="gated"`, `hidden_act="silu"`, no biases
    and, for grouped-query attention, fewer `num_key_value_heads`.

    Args:
        vocab_size (`int`, defaults to 10000): text vocabulary size.
        max_position_embeddings (`int`, defaults to 256): longest text sequence with learned positions (a bound on
            the input); with rotary positions only the default generation length.
        position_embedding_type (`str`, defaults to `"learned"`): `"learned"` (GPT-2) or `"rope"` (rotary, Llama).
        rope_parameters (`dict`, with `"rope"` only): transformers 5's form, `{"rope_type": "default", "rope_theta":
            10000.0}` by default; any of transformers' rotary types (`ROPE_TYPES`: linear, dynamic, yarn, longrope,
            llama3, ...) with its fields, computed by transformers' own rope functions, and `"partial_rotary_factor"`
            to rotate only that fraction of each head's features. `rope_theta=`, `partial_rotary_factor=` or the
            older `rope_scaling=` dict are read into it.
        use_cache (`bool`, defaults to `True`): return the key/value cache for generation.
        sliding_window (`int`, *optional*): every layer's token at position x attends to the tokens in
            (x - sliding_window, x] only, as Mistral's layers do (transformers' definition); None: to every earlier one.
        tie_word_embeddings (`bool`, defaults to `True`): share the LM head with the token embeddings.
        Further arguments: the transformer and p-LaT fields of `PlatConfigBase`.
    """

    model_type = "plat"
    keys_to_ignore_at_inference = [CACHE_NAME]
    family_sizes = ("vocab_size", "max_position_embeddings")

    def __init__(self, vocab_size=10000, max_position_embeddings=256, position_embedding_type="learned",
                 rope_parameters=None, use_cache=True, sliding_window=None, tie_word_embeddings=True, **kwargs):
        self.vocab_size = vocab_size
        self.sliding_window = sliding_window
        self.max_position_embeddings = max_position_embeddings
        rope_parameters = _rope_parameters(
            position_embedding_type, rope_parameters, kwargs.pop("rope_scaling", None), kwargs.pop("rope_theta", None),
            kwargs.pop("partial_rotary_factor", None),
        )  # fmt: skip
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)
        # Set after transformers' own init, which would check rope_parameters itself (a KeyError for a missing
        # field). Absent with learned positions, as on GPT2Config: transformers' rotary code and its model tests
        # read hasattr(config, "rope_parameters") as "has rotary positions".
        self.position_embedding_type = position_embedding_type
        if rope_parameters is not None:
            self.rope_parameters = rope_parameters
        self._check_positions()

    def validate_plat(self):
        super().validate_plat()
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 or None; got {window!r}")
        # Unset only while __init__ runs, which checks them at its end; set fields (--config_overrides) are checked here.
        if "position_embedding_type" in vars(self):
            self._check_positions()

    def _check_positions(self):
        """position_embedding_type, and rope_parameters in transformers 5's form, checked by transformers' own
        validation of its rotary types."""
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}; "
                f"got {self.position_embedding_type!r}"
            )
        parameters = _rope_parameters(self.position_embedding_type, getattr(self, "rope_parameters", None), None, None,
                                      None)  # fmt: skip
        if parameters is None:
            return
        self.rope_parameters = parameters
        rotary_dim = int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"Rotary positions rotate pairs of features: head_dim ({self.head_dim}) times partial_rotary_factor "
                f"must be an even number of at least 2; got {rotary_dim}"
            )
        # Sets original_max_position_embeddings (llama3, yarn, longrope) to max_position_embeddings when not given.
        self.standardize_rope_params()
        try:
            self.validate_rope()
        except KeyError as error:  # a field the rope type needs is missing
            raise ValueError(f"rope_parameters: {error.args[0]}") from None


def _rope_parameters(position_embedding_type, rope_parameters, rope_scaling, rope_theta, partial_rotary_factor):
    """The rotary settings as transformers 5 writes them, or None with learned positions."""
    given = rope_parameters if rope_parameters is not None else rope_scaling
    if position_embedding_type != "rope":
        if given is not None or rope_theta is not None or partial_rotary_factor is not None:
            raise ValueError(
                "rope_parameters, rope_scaling, rope_theta and partial_rotary_factor need "
                f"position_embedding_type='rope'; this config has {position_embedding_type!r}"
            )
        return None
    parameters = dict(given or {})
    parameters.setdefault("rope_type", parameters.pop("type", "default"))
    if parameters["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope_parameters rope_type must be one of transformers' {ROPE_TYPES}; got "
                         f"{parameters['rope_type']!r}")  # fmt: skip
    theta = parameters.setdefault("rope_theta", 10000.0 if rope_theta is None else rope_theta)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise ValueError(f"rope_theta must be a number > 1; got {theta!r}")
    if partial_rotary_factor is not None:
        parameters.setdefault("partial_rotary_factor", partial_rotary_factor)
    factor = parameters.get("partial_rotary_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1]; got {factor!r}")
    return parameters


class PlatVisionConfig(PlatConfigBase):
    r"""Configuration of a p-LaT vision transformer (`PlatVisionModel`, `PlatForImageClassification`), ViT/DeiT-style.

    Args:
        image_size (`int`, defaults to 224): side of the square input images; a multiple of `patch_size`.
        patch_size (`int`, defaults to 16): side of the square patches.
        num_channels (`int`, defaults to 3): image channels (1 for grayscale).
        Further arguments: the transformer and p-LaT fields of `PlatConfigBase`.
    """

    model_type = "plat_vision"
    family_sizes = ("image_size", "patch_size", "num_channels")

    def __init__(self, image_size=224, patch_size=16, num_channels=3, **kwargs):
        self.image_size = image_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        super().__init__(**kwargs)

    def validate_plat(self):
        super().validate_plat()
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
