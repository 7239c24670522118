"""Issue #12, engine side: one bad client, request, frame or callback never stalls, leaks or silently
breaks the engine. Each test reproduces a defect confirmed on wave 1 (see the issue), then checks the fix.
The pool is checked empty through the public stats (what a node sees)."""
import threading
import time

import pytest

from conftest import SimClock, drain, make_observation
from oxygen_ros.engine.requests import Sampling, TextRequest
from oxygen_ros.engine.sessions import Sessions
from oxygen_ros.robot.errors import InputError


def pool_used(engine) -> int:
    return engine.stats.snapshot()["pool_blocks_used"]


# ---------------------------------------------------------------------------------------------- item 1
def test_stop_lists_are_bounded_with_a_clear_error(engine_factory, obs):
    engine = engine_factory(max_stop_strings=4, max_stop_chars=8)
    huge = engine.submit(TextRequest("hi", stop=tuple(f"s{i}" for i in range(200_000)))).result(0)
    assert huge.finish_reason == "refused" and "at most 4 stop strings, got 200000" in huge.error
    long = engine.submit(TextRequest("hi", stop=("x" * 9,))).result(0)
    assert long.finish_reason == "refused" and "at most 8 characters" in long.error
    ok = engine.submit(TextRequest("what is on the table?", max_tokens=3, stop=("zzzz",) * 4))
    engine.run_cycle(obs(0))
    drain(engine)
    assert ok.result(0).success and pool_used(engine) == 0


# ---------------------------------------------------------------------------------------------- item 2
def test_nan_logits_in_a_sampled_row_fail_that_request_alone(engine_factory, obs):
    # On a simulated clock: on the real one a loaded machine timed requests out (30 s from submission)
    # before the drain ended them, and the two runs differed for that reason alone.
    def run(poison: bool):
        engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=2, clock=SimClock())
        sampled = engine.submit(TextRequest("first question", max_tokens=8,
                                            sampling=Sampling(temperature=1.0, seed=1)))
        greedy = engine.submit(TextRequest("second question", max_tokens=8))
        queued_after = [engine.submit(TextRequest(f"later {i}", max_tokens=3)) for i in range(3)]
        if poison:
            real = engine.runner.extend

            def poisoned(rows):
                logits = real(rows).clone()
                target = [s.blocks for s in engine.scheduler.running if s.handle is sampled]
                for i, row in enumerate(rows):
                    if [row.blocks] == target:
                        logits[i] = float("nan")
                return logits
            engine.runner.extend = poisoned
        engine.run_cycle(obs(0))
        drain(engine)
        return engine, sampled.result(0), greedy.result(0), [h.result(0) for h in queued_after]

    _, _, clean_greedy, _ = run(False)
    engine, sampled, greedy, later = run(True)
    assert sampled.finish_reason == "error" and "non-finite logits" in sampled.error
    assert greedy.success and greedy.tokens == clean_greedy.tokens, "the greedy neighbour is unaffected"
    assert all(r.finish_reason in ("error", "length", "eos") for r in later)
    assert engine.stats.counter("nonfinite_logits") >= 1 and engine.stats.counter("faults") >= 1
    assert pool_used(engine) == 0


# ---------------------------------------------------------------------------------------------- item 3
@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0.0, 1e9, "5"])
def test_timeouts_are_validated(engine_factory, timeout):
    engine = engine_factory(max_timeout_s=60.0)
    r = engine.submit(TextRequest("hello there", timeout_s=timeout)).result(0)
    assert r.finish_reason == "refused" and "timeout_s must be in (0, 60] seconds" in r.error
    assert engine.queued_requests == 0


def test_a_request_that_can_never_fit_is_refused_and_blocks_no_one(engine_factory, obs):
    # On a simulated clock: the big request decodes for hundreds of cycles, which on a loaded machine took
    # longer than the requests' 30 s timeout on the real clock.
    engine = engine_factory(kv_budget_mb=0.1, block_size=8, max_tokens_limit=4096, decode_budget="fixed",
                            tokens_per_frame=1, clock=SimClock())
    sched = engine.scheduler
    never = engine.submit(TextRequest("describe everything", max_tokens=4000)).result(0)
    assert never.finish_reason == "refused" and never.error.startswith("can never fit: needs")
    # One that fits only in an empty pool waits without holding up the small ones behind it.
    room = engine.info.kv_blocks - 2 * sched.reserve_blocks      # beside this frame's prefix and the next's
    # fits an otherwise empty pool exactly, not one where any request holds a block
    big_tokens = room * engine.info.block_size - len(engine.question_tokens("hi")) + 1
    first = engine.submit(TextRequest("hi", max_tokens=8))
    engine.run_cycle(obs(0))
    assert engine.active_requests == 1
    big = engine.submit(TextRequest("hi", max_tokens=big_tokens))
    small = [engine.submit(TextRequest("hi", max_tokens=4)) for _ in range(3)]
    assert not big.done()
    engine.run_cycle(obs(1))
    assert all(h.done() or any(s.handle is h for s in sched.running) for h in small), "small ones admitted"
    drain(engine, limit=400)
    assert first.result(0).success and all(h.result(0).success for h in small)
    assert big.result(0).success, "admitted once the pool had room"
    assert pool_used(engine) == 0


def test_queued_requests_time_out_from_submission(engine_factory, obs):
    clock = SimClock()
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="fixed", tokens_per_frame=1,
                            max_active_requests=1)
    running = engine.submit(TextRequest("what is on the table?", max_tokens=50))
    queued = engine.submit(TextRequest("never admitted", max_tokens=5, timeout_s=1.0))
    engine.run_cycle(obs(0))
    assert engine.queued_requests == 1
    clock.advance(1.5)
    engine.run_cycle(obs(1))
    r = queued.result(0)
    assert r.finish_reason == "timeout" and "in the queue" in r.error and r.frame_index == -1
    assert r.latency_s == pytest.approx(1.5)
    running.cancel()
    engine.run_cycle(None)
    assert pool_used(engine) == 0


def test_a_running_request_times_out_counted_from_submission_not_admission(engine_factory, obs):
    clock = SimClock()
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="fixed", tokens_per_frame=1)
    h = engine.submit(TextRequest("what is on the table?", max_tokens=50, timeout_s=1.0))
    clock.advance(0.8)                                   # waits 0.8 s for its first frame
    engine.run_cycle(obs(0))
    assert engine.active_requests == 1
    clock.advance(0.3)                                   # 1.1 s after submission, 0.3 s after admission
    engine.run_cycle(None)
    r = h.result(0)
    assert r.finish_reason == "timeout" and r.queue_s == pytest.approx(0.8) and r.tokens
    assert pool_used(engine) == 0


# ---------------------------------------------------------------------------------------------- item 4
def test_a_raising_chunk_listener_leaks_nothing_and_stops_nothing(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=2)
    seen = []
    engine.add_chunk_listener(lambda chunk: (_ for _ in ()).throw(RuntimeError("listener bug")))
    engine.add_chunk_listener(seen.append)
    h = engine.submit(TextRequest("what is on the table?", max_tokens=4))
    for i in range(5):
        engine.run_cycle(obs(i))
    assert len(seen) == 5, "the next listener still runs"
    assert engine.stats.counter("listener_errors") == 5
    assert h.result(0).success and pool_used(engine) == 0


def test_failures_after_the_frame_compute_release_its_blocks(engine_factory, obs):
    engine = engine_factory(policy="oxygen", memory_every_frames=1)
    real = engine.preparer.robot_actions
    engine.preparer.robot_actions = lambda *a: (_ for _ in ()).throw(ValueError("injected: bad output transform"))
    report = engine.run_cycle(obs(0))
    assert "injected: bad output transform" in report.fault and pool_used(engine) == 0
    engine.preparer.robot_actions = real
    engine.scheduler.submit = lambda *a: (_ for _ in ()).throw(RuntimeError("injected: caption"))
    report = engine.run_cycle(obs(1))
    assert not report.fault and engine.latest_chunk().plan.frame_index == 1
    assert engine.stats.counter("captions_failed") == 1 and pool_used(engine) == 0


def test_a_failure_while_preparing_a_frame_is_that_frames_fault(engine_factory, obs):
    """Anything that raises while a frame is prepared (here the noise of a seed out of range: frame_noise)
    is that frame's fault: counted, the robot's discard listener told, a question's frame just missing;
    repeated, the safe stop. It used to escape the cycle: no chunk ever came and nothing said why."""
    engine = engine_factory(policy="oxygen", max_consecutive_faults=3)
    discarded = []
    engine.add_discard_listener(lambda robot, why: discarded.append(why))
    engine.frame_noise = lambda index: (_ for _ in ()).throw(ValueError("injected: seed out of range"))
    h = engine.submit(TextRequest("what is on the table?", max_tokens=4))
    for i in range(2):
        report = engine.run_cycle(obs(i))
        assert "preparing the frame failed: ValueError: injected: seed out of range" in report.fault
        assert report.chunks == 0 and not engine.faulted
    assert len(discarded) == 2 and "injected: seed out of range" in discarded[0]
    assert engine.stats.counter("faults") == 2 and not h.done()
    engine.run_cycle(obs(2))
    assert engine.faulted.startswith("3 consecutive faulty frames") and h.result(0).finish_reason == "error"
    assert engine.latest_chunk() is None and pool_used(engine) == 0


@pytest.mark.parametrize("stamp", [float("nan"), float("inf"), None])
def test_a_bad_observation_stamp_is_rejected_and_counted(engine_factory, obs, stamp):
    engine = engine_factory(policy="oxygen")
    bad = obs(0)
    bad.stamp_s = stamp
    report = engine.run_cycle(bad)
    assert report.frame_index is None and engine.latest_chunk() is None
    assert engine.stats.counter("bad_observations") == 1
    assert "observation stamp must be a finite number" in engine.stats.snapshot()["last_error"]
    assert pool_used(engine) == 0


def test_a_failed_question_prefill_releases_the_frame_reference(engine_factory, obs):
    engine = engine_factory(policy="oxygen")
    real = engine.runner.extend
    engine.runner.extend = lambda rows: (_ for _ in ()).throw(RuntimeError("injected: question prefill"))
    handles = [engine.submit(TextRequest("what is on the table?", max_tokens=4)) for _ in range(2)]
    engine.run_cycle(obs(0))
    engine.runner.extend = real
    for h in handles:
        r = h.result(0)
        assert r.finish_reason == "error" and "question prefill failed" in r.error
    assert pool_used(engine) == 0, "the frame's blocks and the requests' own blocks are back"


def test_a_failed_admission_releases_what_it_took(engine_factory, obs):
    engine = engine_factory(policy="isolated")
    real = engine.runner.prefill
    calls = {"n": 0}

    def second_fails(*args):                 # the frame's prefill works, the request's own one fails
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected: request prefill")
        return real(*args)

    engine.runner.prefill = second_fails
    h = engine.submit(TextRequest("what is on the table?", max_tokens=4))
    engine.run_cycle(obs(0))
    r = h.result(0)
    assert r.finish_reason == "error" and "could not admit: injected: request prefill" in r.error
    assert pool_used(engine) == 0


# ---------------------------------------------------------------------------------------------- item 5
def test_a_raising_done_callback_never_leaves_another_request_unanswered(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=8)
    handles = [engine.submit(TextRequest("what is on the table?", max_tokens=3)) for _ in range(3)]
    queued = [engine.submit(TextRequest("queued", max_tokens=3)) for _ in range(2)]
    answered = []
    for h in handles + queued:
        h.add_done_callback(lambda reply: (_ for _ in ()).throw(RuntimeError("client bug")))
        h.add_done_callback(answered.append)
    for q in queued:
        q.cancel()                            # removed from the queue, then its callback raises
    engine.run_cycle(obs(0))
    drain(engine)
    assert all(h.done() for h in handles + queued) and len(answered) == 5
    assert engine.stats.snapshot()["callback_errors"] >= 5
    assert pool_used(engine) == 0


# ---------------------------------------------------------------------------------------------- item 6
def test_submit_after_stop_is_refused(engine_factory):
    engine = engine_factory()
    engine.start()
    assert engine.stop()
    r = engine.submit(TextRequest("are you there?", max_tokens=4)).result(0)
    assert r.finish_reason == "refused" and "engine stopped" in r.error
    engine.start()                             # a restarted engine serves again
    try:
        h = engine.submit(TextRequest("are you there?", max_tokens=4))
        engine.submit_observation(make_observation(0))
        assert h.result(timeout=30).success
    finally:
        engine.stop()


def test_a_stop_that_times_out_never_runs_beside_the_live_thread(engine_factory):
    engine = engine_factory(policy="oxygen")
    release, entered = threading.Event(), threading.Event()
    real = engine.runner.actions

    def stuck(*args, **kwargs):                # a device call that hangs
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    engine.runner.actions = stuck
    engine.start()
    h = engine.submit(TextRequest("what is on the table?", max_tokens=4))
    engine.submit_observation(make_observation(0))
    assert entered.wait(30)
    replies = []
    h.add_done_callback(replies.append)
    assert engine.stop(timeout=0.2) is False
    assert not h.done(), "not failed from this thread while the engine thread still holds the request"
    with pytest.raises(RuntimeError, match="has not stopped yet"):
        engine.start()
    release.set()
    r = h.result(timeout=30)
    assert len(replies) == 1 and r.finish_reason == "error" and "engine stopped" in r.error
    for _ in range(100):
        if pool_used(engine) == 0:
            break
        time.sleep(0.05)
    assert pool_used(engine) == 0


# ---------------------------------------------------------------------------------------------- item 8
def test_sessions_keep_cleaned_turns_and_bound_the_session_id():
    sessions = Sessions(max_turns=2, max_chars=100, max_id_chars=8)
    # Padding past max_chars that cleaning removes (far larger raw text is refused before cleaning).
    sessions.record("s1", "hi" + "\0" * 300, "hello\0")
    assert sessions.question("s1", "and now?") == "hi\nhello\nand now?"
    sessions.record("s2", "hi" + "\0" * 1_000_000, "hello")     # refused raw: no megabyte turn is kept
    assert sessions.question("s2", "and now?") == "\nhello\nand now?"
    with pytest.raises(InputError, match="session_id has 9 characters, the limit is 8"):
        sessions.question("x" * 9, "hello")
    with pytest.raises(InputError):
        sessions.record("x" * 9, "hello", "there")
    assert len(sessions) == 2


# ---------------------------------------------------------------------------------------------- item 9
def test_a_new_observation_preempts_a_decode_only_cycle_at_the_next_step(engine_factory, obs):
    clock = SimClock()
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="fixed", tokens_per_frame=10,
                            ignore_eos=True)
    real = engine.runner.extend
    steps = {"n": 0}

    def timed(rows):
        out = real(rows)
        clock.advance(0.01)
        steps["n"] += 1
        if steps["n"] == 3:
            engine.submit_observation(obs(1))          # a camera frame arrives during the third step
        return out

    h = engine.submit(TextRequest("what is on the table?", max_tokens=200))
    engine.run_cycle(obs(0))
    engine.runner.extend = timed
    report = engine.run_cycle(None)
    assert report.preempted and report.decode_steps == 3, report
    h.cancel()
    report = engine.run_frames()               # the pending observation is the next cycle's frame
    assert report.chunks == 1 and engine.latest_chunk().plan.stamp_s == obs(1).stamp_s
    assert pool_used(engine) == 0


# ---------------------------------------------------------------------------------------------- suspected
def test_partials_with_a_nan_timeout_cancel_and_raise_and_inf_means_no_bound(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=4)
    h = engine.submit(TextRequest("what is on the table?", max_tokens=4))
    with pytest.raises(ValueError, match="partials timeout"):
        next(h.partials(timeout=float("nan")))
    assert h.cancelled
    engine.run_cycle(obs(0))
    assert h.result(0).finish_reason == "cancelled"
    g = engine.submit(TextRequest("what is on the table?", max_tokens=4))
    engine.run_cycle(obs(1))
    assert [p.tokens for p in g.partials(timeout=float("inf"))][-1] <= 4
    assert pool_used(engine) == 0


def test_engine_config_lists_every_bad_value_nan_included(engine_factory):
    from oxygen_ros.engine.config import EngineConfig

    with pytest.raises(ValueError) as e:
        EngineConfig(action_rate_hz=float("nan"), memory_period_s=float("inf"), tokens_per_frame=0,
                     policy="fast").validate()
    for part in ("action_rate_hz must be finite", "memory_period_s must be finite",
                 "tokens_per_frame must be >= 1", "policy must be one of"):
        assert part in str(e.value)


def test_bad_request_objects_are_refused_not_raised(engine_factory):
    engine = engine_factory()
    cases = ((TextRequest(b"\xff\xfe"), "not valid UTF-8"), (TextRequest("hi", max_tokens=2.5), "max_tokens"),
             (TextRequest("hi", max_tokens=True), "max_tokens"), (TextRequest("hi", kind="subtask"), "kind"),
             (TextRequest("hi", stop="abc"), "stop strings"), (TextRequest("hi", stop=(3,)), "stop strings"),
             ("hi", "must be a TextRequest"))
    for bad, message in cases:
        r = engine.submit(bad).result(0)
        assert r.finish_reason == "refused" and message in r.error, (bad, r.error)
    assert engine.queued_requests == 0 and engine.stats.counter("refused_invalid") == 7
