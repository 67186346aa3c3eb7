"""Paired comparisons of two arms over the same seeds: the statistics that experiments/README.md promises.

Seeds pair the runs (same initial weights, same batch order), so each comparison is a one-sample question about
the per-seed differences d_i = variant_i - reference_i: their mean with a t-based 95% confidence interval, the
two-sided paired t-test p-value, and the sign count. A contrast of several arms (a weighted sum of their results on
each seed, e.g. a factorial main effect) is the same question about its per-seed values (``one_sample``).
``holm`` adjusts the p-values of a family of comparisons.
"""

import math
import statistics

from scipy import stats

CONFIDENCE = 0.95


def mean_interval(values, confidence=CONFIDENCE):
    """(mean, low, high) of a t-based confidence interval for the mean of ``values`` (nan bounds for one value)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def one_sample(values, confidence=CONFIDENCE):
    """The t statistics of per-seed ``values`` against 0: mean with its interval, two-sided p-value, sign count."""
    n = len(values)
    mean, low, high = mean_interval(values, confidence)
    if n < 2:
        t_value = p_value = math.nan
    else:
        standard_error = statistics.stdev(values) / math.sqrt(n)
        if standard_error == 0:
            t_value = math.copysign(math.inf, mean) if mean else math.nan
            p_value = 0.0 if mean else 1.0
        else:
            t_value = mean / standard_error
            p_value = float(2 * stats.t.sf(abs(t_value), n - 1))
    return {
        "n": n,
        "mean": mean,
        "ci_low": low,
        "ci_high": high,
        "t": t_value,
        "p_value": p_value,
        "positive": sum(v > 0 for v in values),
        "negative": sum(v < 0 for v in values),
    }


def paired_comparison(variant, reference, confidence=CONFIDENCE):
    """The paired statistics of two equal-length sequences of per-seed results, paired by position."""
    if len(variant) != len(reference):
        raise ValueError(f"paired samples need equal lengths; got {len(variant)} and {len(reference)}")
    differences = [a - b for a, b in zip(variant, reference)]
    test = one_sample(differences, confidence)
    return {"n": test.pop("n"), "differences": differences, "mean_difference": test.pop("mean"), **test}


def holm(p_values):
    """Holm's step-down adjustment: the i-th smallest of m p-values times (m - i + 1), kept monotone, at most 1."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [None] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted
