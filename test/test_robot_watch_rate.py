"""StaleWatch (input staleness) and RateMeter (the action publisher's measured rate), on given times."""
import math

import numpy as np
import pytest

from oxygen_ros.robot.rate import RateMeter
from oxygen_ros.robot.watchdog import StaleWatch


def test_never_seen_is_stale_with_infinite_age():
    w = StaleWatch(0.5)
    assert w.stale(10.0) and w.age(10.0) == math.inf and w.last_s is None
    assert w.transitions == 0, "starting stale is not a fresh -> stale transition"


def test_fresh_until_strictly_older_than_the_timeout():
    w = StaleWatch(0.5)
    w.seen(10.0)
    assert not w.stale(10.0) and not w.stale(10.5) and w.stale(10.5001)
    assert w.age(10.25) == pytest.approx(0.25)


def test_each_fresh_to_stale_change_is_counted_once():
    w = StaleWatch(0.5)
    w.seen(0.0)
    for t in (1.0, 1.1, 1.2):                           # one outage, polled three times
        assert w.stale(t)
    assert w.transitions == 1
    w.seen(2.0)
    assert not w.stale(2.1)
    assert w.stale(3.0) and w.transitions == 2
    w.seen(3.1)
    w.seen(5.0)                                         # never polled stale in between: no transition
    assert not w.stale(5.1) and w.transitions == 2


@pytest.mark.parametrize("timeout", [0.0, -1.0, math.nan])
def test_timeout_must_be_positive(timeout):
    with pytest.raises(ValueError, match="stale timeout must be positive"):
        StaleWatch(timeout)


def test_rate_meter_zeros_until_two_ticks():
    m = RateMeter()
    assert m.summary() == {"rate_hz": 0.0, "period_ms_mean": 0.0, "period_ms_std": 0.0, "period_ms_max": 0.0,
                           "ticks": 0}
    m.tick(1.0)
    assert m.summary()["rate_hz"] == 0.0 and m.summary()["ticks"] == 1


def test_rate_meter_measures_rate_jitter_and_worst_period():
    m = RateMeter()
    periods = np.array([10, 20] * 50) * 1e-3           # alternating 10 / 20 ms: 66.7 Hz, std 5 ms
    for t in np.concatenate([[0.0], np.cumsum(periods)]):
        m.tick(float(t))
    s = m.summary()
    assert s["rate_hz"] == pytest.approx(100 / 1.5)
    assert s["period_ms_mean"] == pytest.approx(15.0) and s["period_ms_std"] == pytest.approx(5.0)
    assert s["period_ms_max"] == pytest.approx(20.0) and s["ticks"] == 101


def test_rate_meter_forgets_ticks_beyond_its_window():
    m = RateMeter(window=5)
    for t in (0.0, 1.0, 2.0):                            # 1 Hz, then 10 Hz for the last 5 ticks
        m.tick(t)
    for k in range(1, 5):
        m.tick(2.0 + 0.1 * k)
    s = m.summary()
    assert s["ticks"] == 5 and s["rate_hz"] == pytest.approx(10.0) and s["period_ms_max"] == pytest.approx(100.0)
