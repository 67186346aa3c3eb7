"""The facts of the machine a benchmark ran on, printed beside every ratio: ratios to SDPA depend on the CPU
(its vendor decides how fast MKL's kernels are), on the cores and on the threads far more than on anything
else, so a figure without them cannot be compared with another."""

import os
import platform

import torch


def _cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _physical_cores():
    """Distinct (socket, core) pairs in /proc/cpuinfo; the logical CPU count where that is unavailable."""
    try:
        with open("/proc/cpuinfo") as handle:
            cores, socket = set(), None
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    socket = value.strip()
                elif key.strip() == "core id":
                    cores.add((socket, value.strip()))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count()


def machine_facts(device):
    """Device model, cores, threads and software versions as a flat dict (the same keys on every machine)."""
    is_cuda = device.type == "cuda"
    return dict(
        device=torch.cuda.get_device_name(device) if is_cuda else _cpu_model(),
        cpu=_cpu_model(),
        physical_cores=_physical_cores(),
        logical_cpus=os.cpu_count(),
        threads=torch.get_num_threads(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        torch=torch.__version__,
    )


def facts_label(facts):
    """A short label for the end of a printed line: "AMD EPYC, 2 cores, 1 thread, torch 2.13.0"."""
    threads = facts["threads"]
    return (
        f"{facts['device']}, {facts['physical_cores']} cores, {threads} thread{'s' if threads != 1 else ''}, "
        f"torch {facts['torch']}"
    )
