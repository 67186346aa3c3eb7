"""Spies on the attention dispatcher, shared by the suites that check what it chooses."""

from modeling_plat import plap_dispatch as dispatch


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
