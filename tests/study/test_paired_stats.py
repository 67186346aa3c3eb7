"""The study's statistics against textbook values."""

import math

import pytest
from paired_stats import holm, mean_interval, one_sample, paired_comparison

# Student's (1908) sleep data, Cushny & Peebles: extra hours of sleep of 10 patients under two drugs.
DRUG_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
DRUG_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_paired_t_test_of_the_sleep_data():
    # R: t.test(extra ~ group, data = sleep, paired = TRUE): t = -4.0621, df = 9, p-value = 0.002833,
    # 95 percent confidence interval -2.4598858 -0.7001142, mean difference -1.58.
    result = paired_comparison(DRUG_1, DRUG_2)
    assert result["n"] == 10 and result["mean_difference"] == pytest.approx(-1.58)
    assert result["t"] == pytest.approx(-4.0621, abs=1e-4)
    assert result["p_value"] == pytest.approx(0.002833, abs=1e-6)
    assert (result["ci_low"], result["ci_high"]) == pytest.approx((-2.4598858, -0.7001142), abs=1e-6)
    assert (result["positive"], result["negative"]) == (0, 9)  # one patient slept the same under both


def test_one_sample_test_of_per_seed_values():
    # mean 2, sd 1: t = 2 / (1 / sqrt(3)) = 3.4641 on 2 degrees of freedom, p = 0.0742 (R: t.test(c(1, 2, 3))),
    # 95% interval 2 -/+ 4.3027 / sqrt(3) = [-0.4841, 4.4841].
    result = one_sample([1.0, 2.0, 3.0])
    assert result["n"] == 3 and result["mean"] == 2.0 and result["t"] == pytest.approx(3.4641, abs=1e-4)
    assert result["p_value"] == pytest.approx(0.07418, abs=1e-5)
    assert (result["ci_low"], result["ci_high"]) == pytest.approx((-0.48414, 4.48414), abs=1e-5)
    assert (result["positive"], result["negative"]) == (3, 0)
    # A paired comparison is the one-sample test of its differences.
    paired = paired_comparison(DRUG_1, DRUG_2)
    differences = one_sample([a - b for a, b in zip(DRUG_1, DRUG_2)])
    assert paired["mean_difference"] == differences["mean"]
    assert all(paired[key] == differences[key] for key in ("n", "ci_low", "ci_high", "t", "p_value", "positive"))


def test_interval_of_one_value_is_undefined_and_lengths_must_match():
    mean, low, high = mean_interval([3.0])
    assert mean == 3.0 and math.isnan(low) and math.isnan(high)
    assert math.isnan(paired_comparison([1.0], [0.0])["p_value"])
    with pytest.raises(ValueError, match="equal lengths"):
        paired_comparison([1.0, 2.0], [1.0])


def test_identical_differences_are_certain():
    result = paired_comparison([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
    assert result["p_value"] == 0.0 and result["ci_low"] == result["ci_high"] == 1.0


def test_holm_adjustment():
    # m = 4: 0.005 * 4 = 0.02, 0.01 * 3 = 0.03, 0.03 * 2 = 0.06, 0.04 * 1 = 0.04 -> kept monotone: 0.06.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([]) == []
