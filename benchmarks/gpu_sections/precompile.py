"""Precompilation: the rows of the sections about to run, each once and untimed, side by side in spawned processes.

A check on a fresh machine spends most of its time compiling. Triton builds each specialization of the fused kernels
at its first launch: the kernels section took 95 s as the first section of an H200 run, and 0.4 s after the attention
section had built the same kernels. Inductor compiles each graph of the compile section: 30-37 s for the first call of
a training step. One process compiles one thing at a time. Precompilation runs the sections' rows in several processes
at once, so that what they compile lands in Triton's and Inductor's caches on disk, where the sections' own first calls
find it. The sections then run as before, one process timing on the GPU.

Inductor finds a compiled graph by a key that pickles it, in which torch's memory formats are named after the first
module in ``sys.modules`` that holds torch: in a spawned process, its main script as ``__mp_main__``, which comes first.
gpu_check.py imports multiprocessing, which gives its own main script that name, before torch, so that its keys are its
processes' (else only the kernels that a graph compiles are found, and the graph is compiled again).

A row that fails here fails again in its section, which reports it: precompilation records only how long each row
took, or why it did not finish.
"""

import time

import torch._inductor.config

from .spawned import outcomes


def precompile(jobs, workers, seconds=None):
    """Run each of ``jobs`` ((label, run) pairs, run() a section's row, untimed, picklable) in ``workers`` spawned
    processes within ``seconds`` (None: no limit): {"seconds": precompilation's, "jobs": {label: the seconds its row
    took, or why it did not finish}}. In this process they would only run the rows twice (and leave its Inductor
    with COMPILE_THREADS): ``workers`` must be at least 1."""
    if workers < 1:
        raise ValueError(f"precompilation runs its rows in spawned processes: workers must be at least 1, not {workers}")
    start = time.monotonic()
    done = {}
    for (label, _), outcome in outcomes(jobs, _run_job, workers, seconds):
        if isinstance(outcome, TimeoutError):
            done[label] = "skipped: precompilation's time ran out"
        elif isinstance(outcome, Exception):
            done[label] = f"{type(outcome).__name__}: {outcome}"[:300]
        else:
            done[label] = outcome
    return dict(seconds=time.monotonic() - start, jobs=done)


# Inductor's compile processes in each worker at most: the compile section's 9 rows side by side then start 36 at most,
# where a pool per core in each would start 144 on a 16-core host, each importing torch (tens of gigabytes of memory).
COMPILE_THREADS = 4


def _run_job(job):
    """The seconds that a job's row took (in a worker), with COMPILE_THREADS at most (which Inductor's cache keys
    ignore)."""
    torch._inductor.config.compile_threads = min(COMPILE_THREADS, torch._inductor.config.compile_threads or 1)
    _, run = job
    start = time.perf_counter()
    run()
    return time.perf_counter() - start
