"""p-Laplacian Transformer (p-LaT) for Hugging Face Transformers.

Importing this package registers both p-LaT families with the Auto classes: the language model (``"plat"``:
``PlatConfig``, ``AutoModel`` -> ``PlatModel``, ``AutoModelForCausalLM``) and the vision transformer
(``"plat_vision"``: ``PlatVisionConfig``, ``AutoModel`` -> ``PlatVisionModel``, ``AutoModelForImageClassification``,
``AutoImageProcessor`` -> ``PlatImageProcessor``). Saved checkpoints also carry ``auto_map`` and these files, so
``from_pretrained(..., trust_remote_code=True)`` works without the package installed.

It also registers p-LaT attention with transformers as ``attn_implementation="plap"``, for transformers' own models
(``AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B", attn_implementation="plap")``): see
``attention_interface``.
"""

from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
)
# The class itself: in transformers 5.17 the top-level name is a placeholder needing torchvision (any file mentioning
# TorchvisionBackend is gated on it), which the plugin does not otherwise need.
from transformers.models.auto.image_processing_auto import AutoImageProcessor

from .attention_interface import ATTN_IMPLEMENTATION, mark_plap, plap_attention_forward, plap_mask
from .configuration_plat import PlatConfig, PlatConfigBase, PlatVisionConfig, paper_p_mix
from .image_processing_plat import PlatImageProcessor
from .modeling_plat import (
    PlatForCausalLM,
    PlatForImageClassification,
    PlatModel,
    PlatPreTrainedModel,
    PlatVisionModel,
    PlatVisionPreTrainedModel,
)
from .plap_dispatch import BACKENDS, plap_attention
from .plap_attention_reference import FORMULATIONS, plap_attention_weights

AutoConfig.register(PlatConfig.model_type, PlatConfig, exist_ok=True)
AutoConfig.register(PlatVisionConfig.model_type, PlatVisionConfig, exist_ok=True)
AutoModel.register(PlatConfig, PlatModel, exist_ok=True)
AutoModel.register(PlatVisionConfig, PlatVisionModel, exist_ok=True)
AutoModelForCausalLM.register(PlatConfig, PlatForCausalLM, exist_ok=True)
AutoModelForImageClassification.register(PlatVisionConfig, PlatForImageClassification, exist_ok=True)
AutoImageProcessor.register(PlatVisionConfig, image_processor_classes={"pil": PlatImageProcessor}, exist_ok=True)
AttentionInterface.register(ATTN_IMPLEMENTATION, plap_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, plap_mask)
# No video processor: said explicitly, or pipelines look for one in the checkpoint's remote code and prompt for
# trust_remote_code (their probe derives it from the grayscale image processor's auto_map; any entry for the config,
# even an empty one, counts as local code and stops it). Positional None, because register's keywords differ:
# transformers 5.17 stores the class as given, later versions store {"torchvision": None}, both read as none.
# The class lives on a private path (transformers' top-level name is a placeholder needing torchvision): skipped if
# it moves.
try:
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
except ImportError:
    pass
else:
    AutoVideoProcessor.register(PlatVisionConfig, None, exist_ok=True)

__all__ = [
    "BACKENDS",
    "FORMULATIONS",
    "PlatConfig",
    "PlatConfigBase",
    "PlatForCausalLM",
    "PlatForImageClassification",
    "PlatImageProcessor",
    "PlatModel",
    "PlatPreTrainedModel",
    "PlatVisionConfig",
    "PlatVisionModel",
    "PlatVisionPreTrainedModel",
    "mark_plap",
    "paper_p_mix",
    "plap_attention",
    "plap_attention_weights",
]
