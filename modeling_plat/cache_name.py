"""What the installed transformers calls the KV cache: ``cache`` from 5.24 on, ``past_key_values`` before.

The name is the forward argument that ``generate`` passes, the output field it reads back, and the key that
``Trainer`` drops from predictions; plat's models take either argument and return the installed version's field.
"""

from transformers.modeling_outputs import BaseModelOutputWithPast

CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def given_cache(cache, past_key_values):
    """The one KV cache passed under either name."""
    if cache is not None and past_key_values is not None:
        raise ValueError("Pass the KV cache once: as cache= (transformers >= 5.24) or past_key_values=, not both")
    return cache if cache is not None else past_key_values
