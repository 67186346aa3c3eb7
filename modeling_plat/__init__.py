"""p-Laplacian Transformer (p-LaT) for Hugging Face Transformers.

Importing this package registers PlatConfig and the models with the Auto classes; saved checkpoints also
carry `auto_map` and the modeling files, so `from_pretrained(..., trust_remote_code=True)` works without it.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

from .configuration_plat import PlatConfig, paper_p_mix
from .modeling_plat import (
    PlatForCausalLM,
    PlatForImageClassification,
    PlatModel,
    PlatPreTrainedModel,
    PlatVisionModel,
)
from .plap_attention import BACKENDS, FORMULATIONS, plap_attention, plap_attention_weights

AutoConfig.register("plat", PlatConfig, exist_ok=True)
AutoModel.register(PlatConfig, PlatModel, exist_ok=True)
AutoModelForCausalLM.register(PlatConfig, PlatForCausalLM, exist_ok=True)
AutoModelForImageClassification.register(PlatConfig, PlatForImageClassification, exist_ok=True)

__all__ = [
    "BACKENDS",
    "FORMULATIONS",
    "PlatConfig",
    "PlatForCausalLM",
    "PlatForImageClassification",
    "PlatModel",
    "PlatPreTrainedModel",
    "PlatVisionModel",
    "paper_p_mix",
    "plap_attention",
    "plap_attention_weights",
]
