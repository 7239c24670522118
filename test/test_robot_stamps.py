"""Stamps from another host's clock (robot/stamps.py): the policy for stamps in the future and too old."""
import math

import pytest

from oxygen_ros.robot.errors import ConfigError, InputError, SyncError
from oxygen_ros.robot.stamps import StampCheck

NOW = 1_764_550_000.0   # a wall-clock time in seconds


def test_a_stamp_within_bounds_is_accepted_and_its_age_returned():
    check = StampCheck(max_age_s=0.5, max_future_s=0.05)
    assert check.check("state", NOW - 0.02, NOW) == pytest.approx(0.02)
    assert check.check("state", NOW + 0.049, NOW) == pytest.approx(-0.049)   # sync residual: accepted
    assert check.check("state", NOW - 0.5, NOW) == pytest.approx(0.5)        # the bound itself
    assert check.stats == {"stamps_future": 0, "stamps_too_old": 0}


def test_a_stamp_ahead_of_this_clock_is_rejected_naming_the_offset():
    check = StampCheck(max_age_s=0.5, max_future_s=0.05)
    with pytest.raises(SyncError, match=r"image 'base_0_rgb': stamp is 2\.500 s ahead .*synchronised"):
        check.check("image 'base_0_rgb'", NOW + 2.5, NOW)
    assert check.stats == {"stamps_future": 1, "stamps_too_old": 0}
    assert issubclass(SyncError, InputError)   # nodes log it, count it, and drop the message


def test_a_stamp_too_old_is_rejected_and_an_unset_stamp_is_named():
    check = StampCheck(max_age_s=0.5, max_future_s=0.05)
    with pytest.raises(SyncError, match=r"state: stamp is 0\.800 s old, more than max_stamp_age_s 0\.5$"):
        check.check("state", NOW - 0.8, NOW)
    with pytest.raises(SyncError, match=r"stamp 0: the driver does not set header\.stamp"):
        check.check("state", 0.0, NOW)
    assert check.stats == {"stamps_future": 0, "stamps_too_old": 2}


def test_age_check_off_still_rejects_the_future():
    check = StampCheck(max_age_s=0.0, max_future_s=0.0)
    assert check.check("state", NOW - 3600.0, NOW) == pytest.approx(3600.0)   # a replayed recording
    assert check.check("state", NOW, NOW) == 0.0
    with pytest.raises(SyncError, match="ahead"):
        check.check("state", NOW + 0.001, NOW)


def test_non_finite_stamps_and_bad_bounds():
    check = StampCheck(max_age_s=0.5, max_future_s=0.05)
    for stamp in (math.nan, math.inf, -math.inf):
        with pytest.raises(SyncError, match="not finite"):
            check.check("state", stamp, NOW)
    for age, future in ((-1.0, 0.05), (math.nan, 0.05), (0.5, -0.01), (0.5, math.inf)):
        with pytest.raises(ConfigError):
            StampCheck(age, future)


def test_age_summary_shows_a_clock_ahead_as_negative_ages():
    check = StampCheck(max_age_s=0.5, max_future_s=0.05)
    assert check.age_summary()["stamp_age_ms_min"] is None
    for lag_ms in (-30, 5, 8, 12, 40):            # robot clock ~30 ms ahead on one message
        check.check("state", NOW - lag_ms / 1e3, NOW)
    with pytest.raises(SyncError):
        check.check("state", NOW + 1.0, NOW)       # rejected stamps are not part of the summary
    assert check.age_summary() == {"stamp_age_ms_min": -30.0, "stamp_age_ms_median": 8.0, "stamp_age_ms_max": 40.0}
