"""The kernel tools' tests run as the product suite does (tests/triton_backend.py, on setup.cfg's pytest path), also
alone (``pytest tools/kernels/tests``): on the CPU the one kernel they launch runs under the Triton interpreter. The
tools themselves compile in child processes without it."""

from triton_backend import two_passes  # noqa: F401
