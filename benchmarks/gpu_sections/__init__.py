"""The sections of benchmarks/gpu_check.py, a module for each kind, and the targets judged on their rows."""
