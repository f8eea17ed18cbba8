"""Chi-square goodness of fit without scipy: the regularized upper incomplete gamma function."""
import math

import numpy as np


def _gammq(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): series for x < a + 1, continued fraction otherwise."""
    if x <= 0:
        return 1.0
    gln = math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return 1.0 - total * math.exp(-x + a * math.log(x) - gln)
    b = x + 1 - a
    c = 1e300
    d = 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - gln) * h


def chi2_sf(stat: float, df: int) -> float:
    return _gammq(df / 2.0, stat / 2.0)


def chisq_test(observed: np.ndarray, probs: np.ndarray, min_expected: float = 5.0):
    """Pooled chi-square over several categorical samples.

    ``observed``, ``probs``: (n_states, n_cells) counts and exact probabilities per state.
    Cells with zero probability must have zero counts (asserted); cells expected below
    ``min_expected`` are pooled per state. Returns (statistic, degrees of freedom, p-value)."""
    observed = np.asarray(observed, np.float64)
    probs = np.asarray(probs, np.float64)
    impossible = (probs == 0) & (observed > 0)
    assert not impossible.any(), f"{int(observed[impossible].sum())} samples where p == 0"
    stat, df = 0.0, 0
    for o, p in zip(observed, probs):
        n = o.sum()
        if n == 0:
            continue
        e = n * p
        big = e >= min_expected
        cells_o = list(o[big])
        cells_e = list(e[big])
        rest_e = e[~big & (p > 0)].sum()
        if rest_e > 0:
            cells_o.append(o[~big & (p > 0)].sum())
            cells_e.append(rest_e)
        if len(cells_e) < 2:
            continue
        co, ce = np.array(cells_o), np.array(cells_e)
        stat += float(((co - ce) ** 2 / ce).sum())
        df += len(ce) - 1
    return stat, df, chi2_sf(stat, df) if df > 0 else 1.0
