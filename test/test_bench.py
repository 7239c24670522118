"""CI smoke test of the benchmark (`python -m oxygen_ros.bench`): runs it in-process on the tiny preset with
a few frames and short replies, then checks the JSON the tools read (fields, types) and the equivalence
flags. Not the speed."""
from __future__ import annotations

import json
import math

import pytest

from oxygen_ros.bench.__main__ import main
from oxygen_ros.bench.workload import arrival_schedule, parse_arrival

SETTING_KEYS = {"frame_ms_mean": float, "frame_ms_p50": float, "frame_ms_p99": float, "action_hz": float,
                "tokens_per_s": float, "reply_ms_mean": float, "reply_ms_p99": float, "avg_batch": float,
                "pool_peak_blocks": int, "deadline_misses": int, "speedup_vs_isolated": float}


def _number(x, kind):
    if kind is int:
        return isinstance(x, int) and not isinstance(x, bool)
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    rc = main(["--preset", "tiny", "--frames", "4", "--reply-tokens", "6", "--tokens-per-frame", "2",
               "--repeat", "2", "--warmup-frames", "1", "--check-frames", "1", "--rtc-repeats", "1",
               "--json", str(out), "--quiet"])
    assert rc == 0
    return json.loads(out.read_text())


def test_settings_fields(bench_json):
    # Figures are measured, so nothing here bounds a time: the checks are the identities that tie the
    # reported figures to each other and the counts the workload fixes (the speed lives in the benchmark).
    settings = bench_json["settings"]
    assert list(settings) == ["isolated", "shared_kv", "oxygen"]
    iso = settings["isolated"]
    for name, s in settings.items():
        for key, kind in SETTING_KEYS.items():
            assert _number(s[key], kind), (name, key, s[key])
        assert s["frame_ms_p50"] <= s["frame_ms_p99"] + 1e-9
        assert s["requests"] == 2 * 4 and s["tokens"] == 2 * 4 * 6      # every reply ran to 6 tokens
        assert s["replies_failed"] == 0 and s["unfinished"] == 0 and s["frames"] == 2 * 4
        # action_hz = horizon / mean frame time; the tiny preset's horizon is 10 in every setting
        assert s["action_hz"] * s["frame_ms_mean"] / 1e3 == pytest.approx(10)
        assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["total_s"])
        assert s["speedup_vs_isolated"] == pytest.approx(iso["total_s"] / s["total_s"])
        assert 1 <= s["pool_peak_blocks"] <= 4095
    assert iso["speedup_vs_isolated"] == pytest.approx(1.0) and iso["avg_batch"] == pytest.approx(1.0)
    assert settings["oxygen"]["avg_batch"] > 1.0                      # replies of 3 frames decode together
    ox = settings["oxygen"]
    assert _number(ox["ideal_speedup"], float) and ox["ideal_speedup"] > 0
    assert ox["fraction_of_ideal"] == pytest.approx(ox["speedup_vs_isolated"] / ox["ideal_speedup"])


def test_equivalence_and_pool(bench_json):
    eq = bench_json["equivalence"]
    assert eq["max_action_diff"] <= 1e-5
    assert eq["replies_match"] is True
    assert eq["standalone"]["replies_checked"] >= 1 and eq["standalone"]["replies_match"] is True
    assert bench_json["pool_empty_at_end"] is True


def test_rtc_cost(bench_json):
    # The action step with and without RTC (issue #22): measure() itself refuses a figure whose cycles were
    # not guided as named; here the ratios are what the times say.
    c = bench_json["rtc_cost"]
    for key in ("plain_ms", "rtc_vjp_ms", "rtc_error_ms", "rtc_prefix_ms"):
        assert _number(c[key], float) and c[key] > 0, key
    for kind in ("vjp", "error", "prefix"):
        assert c[f"ratio_{kind}"] == pytest.approx(c[f"rtc_{kind}_ms"] / c["plain_ms"], abs=0.006), kind
    assert (c["repeats"], c["steps"], c["plain_path"]) == (1, 10, "eager")


def test_meta(bench_json):
    meta = bench_json["meta"]
    for key in ("machine", "cpu_model", "cores", "torch", "preset", "parameters", "workload", "repetitions", "date"):
        assert key in meta, key
    assert "triton" in meta
    assert meta["preset"] == "tiny" and meta["repetitions"] == 2
    assert isinstance(meta["parameters"], int) and meta["parameters"] > 1_000_000
    wl = meta["workload"]
    assert (wl["frames"], wl["reply_tokens"], wl["tokens_per_frame"], wl["denoise_steps"]) == (4, 6, 2, 10)


def test_arrival_patterns():
    assert arrival_schedule("every", 4, 0) == [1, 1, 1, 1]
    assert arrival_schedule("every:3", 7, 0) == [1, 0, 0, 1, 0, 0, 1]
    assert arrival_schedule("burst:3", 2, 0) == [3, 3]
    a = arrival_schedule("poisson:1.5", 50, 4)
    assert a == arrival_schedule("poisson:1.5", 50, 4) and 30 < sum(a) < 120
    for bad in ("every:0", "burst:x", "poisson:-1", "sometimes"):
        with pytest.raises(ValueError):
            parse_arrival(bad)


def test_bad_flags():
    with pytest.raises(SystemExit):
        main(["--settings", "isolated,fast"])
    with pytest.raises(SystemExit):
        main(["--tokens-per-frame", "3", "--deadline"])


def test_adversarial_json(tmp_path):
    """`--adversarial` for half a second per phase: the JSON's fields and types, every question accounted
    for with a reason. Rates are not asserted (docs/adversarial_*.json hold the figures)."""
    out = tmp_path / "adv.json"
    assert main(["--preset", "tiny", "--adversarial", "--seconds", "0.5", "--warmup", "0.3", "--threads", "1",
                 "--json", str(out), "--quiet"]) == 0
    adv = json.loads(out.read_text())["adversarial"]
    for phase in ("baseline", "flood"):
        for key, kind in [("chunks_per_s", float), ("max_chunk_gap_ms", float), ("deadline_misses", int),
                          ("tokens_per_s", float), ("questions_answered", int), ("questions_refused", int)]:
            assert _number(adv[phase][key], kind), (phase, key, adv[phase][key])
        assert adv[phase]["questions_without_reason"] == 0
    assert adv["flood"]["questions_answered"] + adv["flood"]["questions_ended"] > 0      # the flood ran
    assert set(adv["targets"]) >= {"chunks_kept", "gap_kept", "language_served", "every_question_has_a_reason"}
    with pytest.raises(SystemExit):
        main(["--adversarial", "--robots", "2"])
