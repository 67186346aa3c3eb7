"""What a call's static facts (shapes, layouts, dtypes, p, a launch configuration) settle, computed once per process."""

import functools

import torch


def eager_cache(function):
    """``function`` with its results kept by its arguments (hashable, and what alone decides the result) in eager
    calls. While torch.compile or torch.export traces, ``function`` itself runs: Dynamo traces through a cache
    wrapper, with a warning to the user."""
    cached = functools.lru_cache(maxsize=1024)(function)

    @functools.wraps(function)
    def call(*args):
        return function(*args) if torch.compiler.is_compiling() else cached(*args)

    call.cache_clear = cached.cache_clear
    return call
