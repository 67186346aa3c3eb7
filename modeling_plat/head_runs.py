"""Runs of consecutive heads that one call can compute together: the one grouping of heads by p.

Each attention function splits its heads by p where its code depends on p: the dispatcher sends runs of p = 2 heads
to softmax attention, the tiled backend raises each run of one exponent with one power, the Triton host code launches
runs of at most two values of p. Each states what a run may hold; ``head_runs`` finds the runs.
"""


def head_runs(values, joins):
    """Runs of consecutive heads as (first, end) pairs covering every head once, in order.

    ``values`` has one entry per head (p, or a function of it); head h extends the run before it while
    ``joins(values[first:h + 1])`` holds for that run's values with h's added, and starts a new run otherwise.
    """
    values = tuple(values)
    runs = []
    for head in range(len(values)):
        if runs and joins(values[runs[-1][0] : head + 1]):
            runs[-1] = (runs[-1][0], head + 1)
        else:
            runs.append((head, head + 1))
    return runs


def one_value(run):
    """``joins`` for runs whose heads share one value."""
    return len(set(run)) == 1
