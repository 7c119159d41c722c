"""The paired t-test behind the verdicts: its t distribution against closed forms and scipy."""

from __future__ import annotations

import math

import pytest

from megakd.repro.stats import (
    claims_verdict,
    compare,
    draw_spread,
    over_draws,
    paired_t_test,
    regularized_incomplete_beta,
    t_two_sided_p,
)


@pytest.mark.parametrize("t", [0.1, 0.7, 2.0, 4.3, 30.0])
def test_t_distribution_matches_closed_forms(t):
    # df = 1 is the Cauchy distribution, df = 2 has P(|T| >= t) = 1 − t / sqrt(2 + t²).
    assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-10, abs=1e-14)
    assert t_two_sided_p(-t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10, abs=1e-14)
    assert t_two_sided_p(0.0, 5) == pytest.approx(1.0)


def test_t_distribution_and_beta_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    special = pytest.importorskip("scipy.special")
    for df in (1, 2, 3, 4, 7, 29, 200):
        for t in (0.05, 0.9, 1.96, 2.776, 6.0, 40.0):
            assert t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-9, abs=1e-15)
    for a, b, x in ((0.5, 0.5, 0.3), (2.5, 0.5, 0.97), (100.0, 0.5, 0.999), (3.0, 7.0, 0.01)):
        assert regularized_incomplete_beta(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-10)


def test_paired_t_test_matches_scipy_and_a_hand_computation():
    a = [0.71, 0.74, 0.69, 0.73, 0.75]
    b = [0.70, 0.71, 0.69, 0.70, 0.72]
    test = paired_t_test(a, b)
    # differences 0.01, 0.03, 0, 0.03, 0.03: mean 0.02, sample std sqrt(0.0008 / 4) = 0.014142
    assert test.mean_diff == pytest.approx(0.02)
    assert test.std_diff == pytest.approx(math.sqrt(0.0008 / 4))
    assert test.t == pytest.approx(0.02 / (math.sqrt(0.0008 / 4) / math.sqrt(5)))
    stats = pytest.importorskip("scipy.stats")
    reference = stats.ttest_rel(a, b)
    assert test.t == pytest.approx(reference.statistic, rel=1e-9)
    assert test.p == pytest.approx(reference.pvalue, rel=1e-9)


def test_directions_and_degenerate_cases():
    better = compare([0.80, 0.82, 0.81, 0.83], [0.70, 0.71, 0.70, 0.72])
    assert better[0] == 1 and better[1].p < 0.05
    assert compare([0.80, 0.82, 0.81, 0.83], [0.70, 0.71, 0.70, 0.72], higher_is_better=False)[0] == -1
    noisy = compare([0.80, 0.70, 0.75], [0.74, 0.76, 0.73])
    assert noisy[0] == 0 and noisy[1].p > 0.05
    same = paired_t_test([0.5, 0.6], [0.5, 0.6])
    assert (same.t, same.p, same.direction()) == (0.0, 1.0, 0)
    constant = paired_t_test([0.5, 0.6], [0.4, 0.5])
    assert (constant.t, constant.p, constant.direction()) == (math.inf, 0.0, 1)
    assert "the same in all 2 seeds" in constant.describe()
    one_seed = paired_t_test([0.9], [0.1])
    assert one_seed.direction() == 0 and "no test" in one_seed.describe()
    with pytest.raises(ValueError, match="equally long"):
        paired_t_test([1.0, 2.0], [1.0])


def test_claims_verdict_rule():
    assert claims_verdict([1, 1, 1]) == "reproduced"
    assert claims_verdict([1, -1, 1]) == "not reproduced at this scale"
    assert claims_verdict([1, 0, 1]) == "inconclusive"
    assert claims_verdict([]) == "inconclusive"


def test_a_finding_over_draws_holds_only_where_the_draws_agree():
    agree = over_draws({0: ("reproduced", "a"), 1: ("reproduced", "b")})
    assert agree == ("reproduced", "draw 0: reproduced (a); draw 1: reproduced (b).")
    verdict, reason = over_draws({0: ("reproduced", "a"), 1: ("not reproduced at this scale", "b")})
    assert verdict == "inconclusive" and reason.startswith("The draws disagree: draw 0: reproduced (a); ")


def test_draw_spread_sets_each_effect_beside_how_far_two_draws_of_one_arm_land():
    # KD lands 0.70 and 0.74 (spread 0.04); TGT is +0.01 on average (within), big +0.10 (beyond)
    text = draw_spread({"KD": [0.70, 0.74], "TGT": [0.72, 0.74], "big": [0.80, 0.84]}, "KD", ["TGT", "big"])
    assert text == ("Draw-to-draw spread of an arm's mean: up to 0.040; against KD: TGT +0.010, big +0.100 "
                    "(TGT within the spread).")
    assert draw_spread({"a": [0.5, 0.5], "b": [0.7, 0.7]}, "a", ["b"]).endswith("b +0.200 (all beyond the spread).")
