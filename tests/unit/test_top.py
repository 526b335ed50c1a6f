"""`tierps admin top`'s latency quantiles from a Prometheus histogram, against numpy's
quantile of the observations themselves."""

from __future__ import annotations

import math

import numpy as np

from tierps.client.top import quantile
from tierps.server.metrics import LATENCY_BUCKETS


def test_histogram_quantiles_land_in_the_bucket_of_the_true_quantile() -> None:
    """Interpolating inside a bucket (as Prometheus' histogram_quantile) can miss the true
    quantile by at most that bucket's width; observations past the last bound read as it."""
    rng = np.random.default_rng(3)
    seconds = rng.lognormal(mean=math.log(0.004), sigma=1.0, size=20_000)
    bounds = [*LATENCY_BUCKETS, math.inf]
    cumulative = {le: float(np.count_nonzero(seconds <= le)) for le in bounds}
    for q in (0.5, 0.9, 0.99):
        true = float(np.quantile(seconds, q))
        got = quantile(cumulative, q)
        upper = next(le for le in bounds if le >= true)
        lower = max([0.0, *(le for le in bounds if le < upper)])
        assert got is not None and lower <= got <= upper, (q, true, got, lower, upper)
    assert quantile({le: 0.0 for le in bounds}, 0.5) is None
    past = {**{le: 0.0 for le in LATENCY_BUCKETS}, math.inf: 5.0}
    assert quantile(past, 0.99) == LATENCY_BUCKETS[-1]
