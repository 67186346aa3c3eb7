"""Work side by side in spawned processes within a time budget: the sweep's cases, precompilation's rows."""

import contextlib
import functools
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor


def outcomes(items, runner, workers=0, seconds=None):
    """(item, outcome) of each of ``items``, in their order: runner(item)'s result, or the exception it raised, a
    TimeoutError where ``seconds`` (None: no limit) ran out before it. With ``workers``, in that many spawned processes
    (``runner`` and the items must pickle), so that a crashed kernel cannot take this process along; those still at
    work when the time runs out are killed, not waited for. Without, in this process, one after the other."""
    deadline = None if seconds is None else time.monotonic() + seconds
    with contextlib.ExitStack() as stack:
        if workers:
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            futures = [pool.submit(runner, item) for item in items]
            stack.callback(_stop, pool, futures)
            calls = [functools.partial(_result_by, future, deadline) for future in futures]
        else:
            calls = [functools.partial(_run_by, runner, item, deadline) for item in items]
        for item, call in zip(items, calls):
            try:
                outcome = call()
            except Exception as error:
                outcome = error
            yield item, outcome


def _stop(pool, futures):
    """Shut the pool down: at once where all of ``futures`` are done, else with the work still running killed (or the
    interpreter's exit would wait for it: minutes of a lease, for a compilation that no one reads)."""
    if all(future.done() for future in futures):
        pool.shutdown()
        return
    processes = list(pool._processes.values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()


def _result_by(future, deadline):
    return future.result(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))


def _run_by(runner, item, deadline):
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError
    return runner(item)
