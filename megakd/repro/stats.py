"""The paired test over seeds behind every verdict that claims a difference, and the shared verdict rules.

scipy is only a development dependency, so Student's t distribution is computed here from the
regularized incomplete beta function (a continued fraction, accurate to ~1e-12); tests compare it
with scipy.stats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.05  # significance level of every paired test in the report


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), converging for x < (a + 1) / (a + b + 2)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the CDF of the Beta(a, b) distribution at x."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _incomplete_beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


@dataclass(frozen=True)
class PairedTest:
    """A paired t-test of a − b over seeds: mean difference, its sample std, t, two-sided p."""

    mean_diff: float
    std_diff: float
    t: float
    p: float
    n: int

    def direction(self, alpha: float = ALPHA) -> int:
        """+1 if a > b significantly, −1 if a < b significantly, 0 otherwise (or with fewer than 2 pairs)."""
        if self.n < 2 or not self.p < alpha:
            return 0
        return 1 if self.mean_diff > 0 else -1

    def describe(self, unit: str = "") -> str:
        if self.n < 2:
            return f"{self.mean_diff:+.3g}{unit} (one seed: no test)"
        if math.isinf(self.t):  # a zero-variance difference (e.g. models that predict one class in every seed)
            return f"{self.mean_diff:+.3g}{unit} (the same in all {self.n} seeds: t = {self.t:.0f}, p = 0)"
        p = f"p = {self.p:.2g}" if self.p >= 1e-4 else "p < 1e-4"
        return f"{self.mean_diff:+.3g}{unit} (paired t = {self.t:.2f}, {p}, {self.n} seeds)"


def paired_t_test(a: list[float], b: list[float]) -> PairedTest:
    """Paired t-test of a − b (seed i of `a` against seed i of `b`); identical pairs give t = 0, p = 1."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_t_test: expected two equally long non-empty lists, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return PairedTest(mean, 0.0, math.nan, math.nan, n)
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    if std == 0.0:
        t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    else:
        t = mean / (std / math.sqrt(n))
    return PairedTest(mean, std, t, t_two_sided_p(t, n - 1), n)


def compare(a: list[float], b: list[float], higher_is_better: bool = True) -> tuple[int, PairedTest]:
    """(+1 a better, −1 a worse, 0 no significant difference) and the test of a − b."""
    test = paired_t_test(a, b)
    return test.direction() * (1 if higher_is_better else -1), test


def claims_verdict(outcomes: list[int]) -> str:
    """The verdict of a finding made of directional claims, each +1 (holds), −1 (reversed) or 0
    (no significant difference).

    Reproduced if every claim holds; not reproduced at this scale if any is significantly
    reversed; otherwise inconclusive (the measured differences are within seed noise).
    """
    if outcomes and all(o == 1 for o in outcomes):
        return "reproduced"
    if any(o == -1 for o in outcomes):
        return "not reproduced at this scale"
    return "inconclusive"


def draws_verdict(verdicts: list[str]) -> str:
    """A finding measured on several pretraining draws: the draws' common verdict, inconclusive if they differ."""
    return verdicts[0] if len(set(verdicts)) == 1 else "inconclusive"


def over_draws(per_draw: dict[int, tuple[str, str]]) -> tuple[str, str]:
    """`draws_verdict` of each draw's (verdict, reason), with every draw's reason (and, when they differ,
    that the draws disagree)."""
    verdicts = [v for v, _ in per_draw.values()]
    reason = "; ".join(f"draw {d}: {v} ({why})" for d, (v, why) in per_draw.items()) + "."
    return draws_verdict(verdicts), ("The draws disagree: " if len(set(verdicts)) > 1 else "") + reason


def draw_spread(arm_means: dict[str, list[float]], reference: str, compared: list[str], unit: str = "") -> str:
    """The effects of `compared` arms against `reference` (mean over draws) beside the draw-to-draw spread
    of an arm's mean (how far two pretraining runs of one recipe land apart); `arm_means`: arm -> its mean
    per draw."""
    spread = max(max(v) - min(v) for v in arm_means.values())
    draws = len(arm_means[reference])
    effects = {a: (sum(arm_means[a]) - sum(arm_means[reference])) / draws for a in compared}
    within = [a for a, e in effects.items() if abs(e) <= spread]
    return (f"Draw-to-draw spread of an arm's mean{unit}: up to {spread:.3f}; against {reference}: "
            + ", ".join(f"{a} {e:+.3f}" for a, e in effects.items())
            + (f" ({', '.join(within)} within the spread)." if within else " (all beyond the spread)."))
