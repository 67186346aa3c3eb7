"""Spies on the attention dispatcher, shared by the suites that check what it chooses."""

import importlib

# The package exports the function plap_attention under the module's name.
dispatch = importlib.import_module("modeling_plat.plap_attention")


def record_chosen_backends(monkeypatch):
    """The names of the backends ``choose_backend`` returns from now on, eager calls and traced ones alike (heads with
    p = 2 go to SDPA unasked)."""
    names = []
    choose = dispatch.choose_backend

    def recording(*args, **kwargs):
        backend = choose(*args, **kwargs)
        names.append(backend.name)
        return backend

    monkeypatch.setattr(dispatch, "choose_backend", recording)
    return names
