"""Names of the fused backends' custom ops (``torch.library.custom_op``), which torch.compile and torch.export
trace through as one opaque node each way."""

import re


def op_name(module_name, name):
    """A custom-op name unique to the defining module's import path: a checkpoint's remote-code copy of the
    backends registers its own ops beside the installed plugin's."""
    return "plat::" + re.sub(r"\W", "_", module_name) + "_" + name
