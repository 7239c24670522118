"""Language never stalls (issue 33): whatever the frames do, every question ends by itself (a reply: EOS, a
stop string or its length) within a bounded number of cycles, in cycles without a frame too.

The in-process property: any mix of 1-32 questions of up to the longest length allowed, asked after a few
frames about the frame that follows them (as an openpi client and the evaluation ask: the question, then its
frame), then only cycles without a frame (`run_cycle()` without an observation: a paused camera, a client
waiting for its reply). Each draw (fixed seeds) also draws the engine's settings (batch cap, prefill chunk,
minimum decode steps) and a text forward that costs less than linear in its tokens with measurement jitter
(a CPU's: the cost model's unconstrained fit of it goes negative), on a simulated clock: the bound is on
cycles, never on wall time. Every frame-less cycle prefills at least the budget's chunk of question tokens
(or what is left) and decodes at least one step, and a request that was not admitted at its frame is
admitted onto that frame, held for it, in a cycle without one: so the bound is the work itself, counted in
minimum chunks and reply tokens.

Through the openpi socket (oxygen_ros/serve, its engine on its own thread, in real time): each client sends
its question with an observation and waits for the reply without sending another frame. Wall time there is
bounded only generously (the request's own timeout); the assertion is that every reply comes, with its
reason.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from conftest import ACTION_S, PREFILL_S, SimClock, make_observation, simulate_costs
from oxygen_ros.engine.requests import Sampling, TextRequest

# openpi-client 0.1.2 connects without a context manager, which websockets 17 deprecates (it still works).
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")

SEEDS = range(12)
SOCKET_TIMEOUT_S = 120.0     # wall time a socket question may take: generous (a few seconds here when idle)
WORDS = ("cube", "red", "left", "gripper", "table", "how", "far", "is", "the", "what", "colour", "?")


def sublinear_costs(engine, clock: SimClock, rng: np.random.Generator) -> None:
    """The runner's operations advance the simulated clock; a text forward costs less than linear in its
    tokens (a fixed overhead, then tokens^0.75), times a jitter of +-25% (seeded)."""
    runner = engine.runner

    def wrap(name, cost):
        real = getattr(runner, name)

        def timed(*args, **kwargs):
            out = real(*args, **kwargs)
            clock.advance(cost(*args) * rng.uniform(0.75, 1.25))
            return out
        setattr(runner, name, timed)

    wrap("prefill", lambda *a: PREFILL_S)
    wrap("actions", lambda *a: ACTION_S)
    wrap("extend", lambda rows: 0.006 + 0.0008 * len(rows) + 0.0004 * sum(len(r.tokens) for r in rows) ** 0.75)


def draw_questions(rng: np.random.Generator, max_chars: int, max_tokens: int) -> list[TextRequest]:
    """1-32 questions: lengths from one word to `max_chars` characters (a third of them long), replies of
    1..max_tokens tokens, greedy or sampled."""
    questions = []
    for _ in range(int(rng.integers(1, 33))):
        chars = int(rng.integers(1, max_chars + 1)) if rng.random() < 1 / 3 else int(rng.integers(1, 80))
        text = " ".join(rng.choice(WORDS, size=chars))[:chars].strip() or "cube"
        sampling = Sampling(temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 30))) if rng.random() < 0.5 \
            else Sampling()
        questions.append(TextRequest(text, max_tokens=int(rng.integers(1, max_tokens + 1)), sampling=sampling,
                                     timeout_s=300.0))
    return questions


@pytest.mark.parametrize("seed", SEEDS)
def test_any_mix_of_questions_finishes_without_frames(engine_factory, seed):
    rng = np.random.default_rng(seed)
    clock = SimClock()
    engine = engine_factory(clock=clock, decode_budget="deadline", action_rate_hz=25.0, kv_budget_mb=32.0,
                            max_queued_per_owner=32, max_active_requests=int(rng.choice([4, 8, 32])),
                            prefill_chunk_tokens=int(rng.choice([8, 64])),
                            min_tokens_per_frame=int(rng.choice([0, 1])), ignore_eos=bool(rng.random() < 0.5))
    sublinear_costs(engine, clock, rng)
    for i in range(3):                                          # a few frames: the cost model's first figures
        engine.run_cycle(make_observation(i))
    config = engine.config
    questions = draw_questions(rng, config.max_question_chars, config.max_tokens_limit)
    handles = [engine.submit(q) for q in questions]
    assert not any(h.done() for h in handles), [h.result(0).error for h in handles if h.done()]
    engine.run_cycle(make_observation(3))                       # the frame they ask about; then none
    # The work counted in minimum units: each question's tokens in prefill chunks, each reply token a step,
    # plus a cycle per question to be admitted (at most one a cycle when a single one finishes).
    bound = sum(math.ceil(len(engine.question_tokens(q.text)) / config.prefill_chunk_tokens) + q.max_tokens + 1
                for q in questions)
    cycles = 0
    while not all(h.done() for h in handles):
        assert cycles < bound, (f"{sum(not h.done() for h in handles)} of {len(handles)} questions still open "
                                f"after {cycles} cycles without a frame")
        engine.run_cycle()
        cycles += 1
    replies = [h.result(0) for h in handles]
    assert all(r.success and r.finish_reason in ("eos", "stop", "length") for r in replies), \
        [(r.finish_reason, r.error) for r in replies if not r.success]
    assert all(r.frame_index == replies[0].frame_index for r in replies)        # all about the frame that came
    assert engine.runner.pool.blocks.num_used == 0 and not engine.conversation.held   # nothing held after them


def test_a_cost_model_that_predicts_nothing_fits_cannot_stall_a_cycle_without_a_frame(engine_factory, obs):
    """A load spike measured a question prefill at 10 s and a decode step at 10 s: the model now says that no
    token and no step fits in a frame period. A cycle without a frame still prefills the minimum chunk and
    decodes one step (min_tokens_per_frame is 0 here): the work goes on, and is measured again."""
    clock = SimClock()
    engine = engine_factory(clock=clock, decode_budget="deadline", action_rate_hz=25.0, min_tokens_per_frame=0,
                            prefill_chunk_tokens=8, ignore_eos=True)
    simulate_costs(engine, clock)
    short = engine.submit(TextRequest("hi", max_tokens=200))
    engine.run_cycle(obs(0))
    long = engine.submit(TextRequest("what colour is the cube on the left? " * 50, max_tokens=5))
    engine.run_cycle(obs(1))
    for rows, tokens in [(1, 1), (1, 64), (2, 2)]:
        engine.scheduler.budget.observe(rows, tokens, 10.0)
    report = engine.run_cycle()
    assert report.question_tokens >= 8 and report.decode_steps >= 1 and report.tokens >= 1, report
    assert not long.done() and not short.done()


def test_a_question_not_admitted_at_its_frame_is_admitted_without_one(engine_factory, obs):
    """The batch holds 2: of 4 questions asked with one frame, 2 wait. No frame follows (the client waits for
    its reply; the camera paused): they are admitted onto that frame, held for them, and answered about it;
    the frame is released once nothing waits for it."""
    engine = engine_factory(max_active_requests=2, ignore_eos=True, decode_budget="fixed", tokens_per_frame=1)
    engine.run_cycle(obs(0))
    handles = [engine.submit(TextRequest("what is on the table?", max_tokens=6)) for _ in range(4)]
    engine.run_cycle(obs(1))
    frame = engine.scheduler.running[0].frame
    assert engine.queued_requests == 2 and list(engine.conversation.held) == [""]
    for _ in range(40):
        if all(h.done() for h in handles):
            break
        engine.run_cycle()
    replies = [h.result(0) for h in handles]
    assert all(r.success and len(r.tokens) == 6 for r in replies)
    assert {r.frame_index for r in replies} == {frame.frame_index}
    assert not engine.conversation.held and engine.runner.pool.blocks.num_used == 0


def test_a_frame_is_held_only_while_the_pool_keeps_its_reserve(engine_factory, obs):
    """Holding a frame must never take the room the next cycle's frame needs: with the pool too full to keep
    the reserve beside it, the waiting question is not given the frame (it waits for the robot's next one)."""
    engine = engine_factory(ignore_eos=True, decode_budget="fixed", tokens_per_frame=1)
    blocks = engine.runner.pool.blocks
    engine.run_cycle(obs(0))
    waiting = engine.submit(TextRequest("what is on the table?", max_tokens=50))
    taken = blocks.allocate(blocks.num_free - engine.scheduler.reserve_blocks)   # room for the frame alone
    engine.run_cycle(obs(1))
    assert engine.queued_requests == 1 and not engine.conversation.held
    blocks.decref(taken)
    taken = blocks.allocate(blocks.num_free - 2 * engine.scheduler.reserve_blocks)  # the frame and the reserve
    engine.run_cycle(obs(2))                                    # not admitted, but the frame is held for it
    assert engine.queued_requests == 1 and list(engine.conversation.held) == [""]
    blocks.decref(taken)
    engine.stop()
    assert waiting.result(0).finish_reason == "error" and not engine.conversation.held
    assert blocks.num_used == 0


# ---------------------------------------------------------------------------------------------- the socket
def _ask_over_the_socket(server, question: TextRequest, rng_seed: int, out: list, i: int) -> None:
    from test_openpi_serve import client, droid_obs

    policy = client(server)
    try:
        rng = np.random.default_rng(rng_seed)
        policy.infer(droid_obs(rng))                             # a few frames first
        policy.infer(droid_obs(rng))
        out[i] = policy.infer({**droid_obs(rng), "question": question.text, "max_tokens": question.max_tokens,
                               "timeout_s": question.timeout_s})
    except RuntimeError as e:                                    # the server's error text (e.g. a timeout)
        out[i] = str(e)
    except Exception as e:  # noqa: BLE001 - reported by the test
        out[i] = repr(e)
    finally:
        policy._ws.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_any_mix_of_questions_finishes_over_the_openpi_socket(seed):
    """Seed 0: one question of the longest length with the longest reply (the issue's 2,000 characters and
    256 tokens), seed 1: a mix of up to 32 clients, one question each, a decode batch of 4. Each client sends
    its question with an observation and then no frame until its reply: every reply comes, ended by EOS or
    its length (a question the batch had no room for at its frame used to wait for a frame that never came,
    until its timeout)."""
    from test_openpi_serve import base_engine, served

    rng = np.random.default_rng(seed)
    # seed 1: a batch of 4, so most questions are not admitted at their own frame (and no other comes)
    engine = base_engine("droid", ignore_eos=seed == 0, max_active_requests=32 if seed == 0 else 4)
    limit = engine.config.max_question_chars
    if seed == 0:
        questions = [TextRequest(("what colour is the cube on the left of the table? " * 60)[:limit],
                                 max_tokens=engine.config.max_tokens_limit, timeout_s=SOCKET_TIMEOUT_S)]
    else:
        questions = [TextRequest(q.text, max_tokens=q.max_tokens, timeout_s=SOCKET_TIMEOUT_S)
                     for q in draw_questions(rng, limit, engine.config.max_tokens_limit)]
    with served("droid", base=engine, max_clients=32) as server:
        out: list = [None] * len(questions)
        threads = [threading.Thread(target=_ask_over_the_socket, args=(server, q, 100 + i, out, i), daemon=True)
                   for i, q in enumerate(questions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOCKET_TIMEOUT_S + 60.0)                     # beyond the requests' own timeout: a hang
        assert not any(t.is_alive() for t in threads)
    errors = [r for r in out if not isinstance(r, dict)]
    assert not errors, errors[:3]
    assert all(r["finish_reason"] in ("eos", "length") for r in out), [r["finish_reason"] for r in out]
    if seed == 0:
        assert out[0]["finish_reason"] == "length" and out[0]["tokens"] == engine.config.max_tokens_limit


# ------------------------------------------------------------------------- no frame after the question
def test_a_question_asked_after_the_last_frame_is_answered_about_it_without_a_chunk(engine_factory, obs):
    """The camera paused (or the client waits for its reply) before the questions were asked: no frame ever
    comes again. After a camera interval without one, the robot's last frame is prefilled again and the
    questions are admitted onto it (a batch of 2: the others wait on it, held) and answered, each by EOS or
    its length, about that frame; no chunk comes of it (not a new observation); it counts as re-used, not as
    a frame, a chunk or a dropped observation. The engine loop waits a frame period between cycles that run
    nothing: so does the simulated clock here."""
    clock = SimClock()
    engine = engine_factory(clock=clock, max_active_requests=2, ignore_eos=True, decode_budget="fixed",
                            tokens_per_frame=2)
    simulate_costs(engine, clock)
    chunks = []
    engine.add_chunk_listener(chunks.append)
    for i in range(3):
        engine.run_cycle(obs(i))
    last = engine.latest_chunk()
    handles = [engine.submit(TextRequest("what is on the table?", max_tokens=5, timeout_s=300.0))
               for _ in range(5)]
    before = engine.stats.snapshot()
    cycles = 0
    while not all(h.done() for h in handles):
        assert cycles < 40, f"{sum(not h.done() for h in handles)} of 5 questions still open after {cycles} cycles"
        report = engine.run_cycle()
        assert report.chunks == 0 and not report.robots
        if not report.tokens:
            clock.advance(engine.frame_period)
        cycles += 1
    replies = [h.result(0) for h in handles]
    assert all(r.success and r.finish_reason == "length" and len(r.tokens) == 5 for r in replies), replies
    assert {r.frame_index for r in replies} == {2}              # the last frame, the one they are about
    after = engine.stats.snapshot()
    assert len(chunks) == 3 and engine.latest_chunk() is last
    assert after["frames"] == before["frames"] == 3 and after["dropped_frames"] == before["dropped_frames"]
    assert after["reused_frames"] == 1 and after["robots"][""]["reused_frames"] == 1   # then held, not re-made
    assert engine.runner.pool.blocks.num_used == 0 and not engine.conversation.held


def test_a_frame_is_not_reused_while_the_cameras_next_one_is_expected(engine_factory, obs):
    """A live camera every 0.1 s: a question asked just after a frame waits for the next one (its answer is
    about the newest observation, and a flood of questions costs no extra prefill) until its camera is a
    quarter interval late; only then is the last frame re-used."""
    clock = SimClock()
    engine = engine_factory(clock=clock, ignore_eos=True, decode_budget="fixed", tokens_per_frame=1)
    for i in range(4):
        engine.submit_observation(obs(i))
        engine.run_cycle()
        clock.advance(0.1)
    clock.advance(-0.1 + 0.01)                                  # 10 ms after the last frame arrived
    handle = engine.submit(TextRequest("what is on the table?", max_tokens=3, timeout_s=300.0))
    engine.run_cycle()
    clock.advance(0.1)                                          # 110 ms: the next frame is late, not lost
    engine.run_cycle()
    assert engine.stats.counter("reused_frames") == 0 and engine.queued_requests == 1
    clock.advance(0.02)                                         # 130 ms: over a quarter interval late
    engine.run_cycle()
    assert engine.stats.counter("reused_frames") == 1 and engine.queued_requests == 0
    for _ in range(10):
        engine.run_cycle()
    assert handle.result(0).success and handle.result(0).frame_index == 3


def test_a_question_for_a_robot_that_never_sent_a_frame_ends_with_a_clear_error(engine_factory, obs):
    """Robot 'arm' joined but never sent a frame: its question ends with an error that says so once it has
    waited FIRST_FRAME_WAIT_S, not at its timeout (300 s); the other robot's question is answered meanwhile."""
    from oxygen_ros.engine.intake import FIRST_FRAME_WAIT_S

    clock = SimClock()
    engine = engine_factory(clock=clock, ignore_eos=True, decode_budget="fixed", tokens_per_frame=2)
    engine.add_robot("arm", engine.preparer)
    lost = engine.submit(TextRequest("what is on the table?", max_tokens=3, owner="arm", timeout_s=300.0))
    seen = engine.submit(TextRequest("what is on the table?", max_tokens=3, owner="", timeout_s=300.0))
    for i in range(int(FIRST_FRAME_WAIT_S / 0.1) + 2):
        if lost.done():
            break
        engine.run_frames({"": obs(i)})
        clock.advance(0.1)
    reply = lost.result(0)
    assert reply.finish_reason == "error" and "no frame yet from robot 'arm'" in reply.error, reply
    assert reply.latency_s <= FIRST_FRAME_WAIT_S + 0.2
    assert seen.result(0).success


def test_a_never_framed_robots_refusal_ends_only_its_own_questions(engine_factory, obs):
    """Robot 'arm' never sends a frame; the robot "" does, and has a question waiting (the batch is full)
    when arm's question is refused: that refusal ends arm's questions only."""
    from oxygen_ros.engine.intake import FIRST_FRAME_WAIT_S

    clock = SimClock()
    engine = engine_factory(clock=clock, ignore_eos=True, decode_budget="fixed", tokens_per_frame=1,
                            max_active_requests=1)
    engine.add_robot("arm", engine.preparer)
    engine.run_frames({"": obs(0)})
    busy = engine.submit(TextRequest("what is on the table?", max_tokens=200, owner="", timeout_s=300.0))
    engine.run_frames({"": obs(1)})
    queued = engine.submit(TextRequest("and now?", max_tokens=2, owner="", timeout_s=300.0))
    lost = engine.submit(TextRequest("what is on the table?", max_tokens=3, owner="arm", timeout_s=300.0))
    for i in range(2, int(FIRST_FRAME_WAIT_S / 0.1) + 4):
        if lost.done():
            break
        clock.advance(0.1)
        engine.run_frames({"": obs(i)})
    assert "no frame yet from robot 'arm'" in lost.result(0).error
    assert not busy.done() and not queued.done(), queued.result(0) if queued.done() else "running"
    busy.cancel()
    engine.run_frames({"": obs(50)})
    engine.run_frames({"": obs(51)})
    assert queued.result(0).success


def test_a_reused_frame_never_takes_the_next_cycles_kv_reserve(engine_factory, obs):
    """A robot's last frame is prefilled again for its waiting question only while the pool keeps the next
    cycle's reserve beside it: one block short of reserve + a frame's prefix, nothing is re-used."""
    clock = SimClock()
    engine = engine_factory(clock=clock, ignore_eos=True, decode_budget="fixed", tokens_per_frame=2)
    engine.run_cycle(obs(0))
    handle = engine.submit(TextRequest("what is on the table?", max_tokens=2, timeout_s=300.0))
    clock.advance(2 * engine.info.chunk_period_s)                  # the camera paused
    blocks = engine.runner.pool.blocks
    need = engine.scheduler.reserve_blocks + engine._robots.prefix_blocks
    hog = blocks.allocate(blocks.num_free - need + 1)
    engine.run_cycle()
    assert engine.stats.counter("reused_frames") == 0 and engine.queued_requests == 1
    blocks.decref(hog[:1])
    engine.run_cycle()
    assert engine.stats.counter("reused_frames") == 1
    blocks.decref(hog[1:])
    for _ in range(4):
        engine.run_cycle()
    assert handle.result(0).success and handle.result(0).frame_index == 0


def test_reuse_waits_for_a_newer_prepared_frame():
    """A robot whose newer frame is prepared (the preparer thread made it) is not given its old frame again."""
    from oxygen_ros.engine.cycle import Frame
    from oxygen_ros.engine.intake import Intake, Pending

    intake = Intake(("",))
    intake.keep(Frame("", 0, None, None, None, 0.0, "task"), used=0.0)
    assert intake.reusable("", now=10.0, period=0.1) is not None
    intake.put_ready("", Pending(object(), None, deadline=10.5))
    assert intake.reusable("", now=10.0, period=0.1) is None
    intake.take_due(1, prepared_only=True)
    assert intake.reusable("", now=10.0, period=0.1) is not None


def test_a_paused_camera_is_expected_only_a_quarter_interval_late():
    """A camera every 0.1 s: its next frame is expected up to 25% of an interval late, then not at all (the
    cycles' language is no longer cut short for a frame that does not come)."""
    from oxygen_ros.engine.intake import Intake, Pending

    intake = Intake(("",))
    for t in (0.0, 0.1, 0.2):
        intake.put("", Pending(object(), None, t + 0.5), arrived=t)
    assert intake.next_arrival(0.25) == pytest.approx(0.3)
    assert intake.next_arrival(0.32) == pytest.approx(0.32)        # 20% late: expected now
    assert intake.next_arrival(0.2 + 0.1 * 1.3) is None
    assert intake.next_arrival(0.2 + 0.1 * 3) is None


def test_a_question_sent_with_an_observation_is_answered_about_that_frame_not_an_older_one(engine_factory):
    """A question carries its observation's stamp (openpi's socket sends both in one message): a frame of its
    robot stamped before it is not its frame, whether it is this cycle's or one the engine holds or re-uses;
    it waits for its observation's frame."""
    engine = engine_factory()
    engine.run_cycle(make_observation(0))                                      # frame 0, stamp 0.0
    handle = engine.submit(TextRequest("what is on the table?", max_tokens=2,
                                       not_before_stamp=make_observation(5).stamp_s))
    engine.run_cycle(make_observation(1))                                      # frame 1, stamp 0.1: too old
    engine.run_cycle()                                                         # no frame: nothing older either
    assert not handle.done() and engine.queued_requests == 1
    engine.run_cycle(make_observation(5))                                      # frame 2: its observation
    for _ in range(20):
        if handle.done():
            break
        engine.run_cycle()
    reply = handle.result(0)
    assert reply.success and reply.frame_index == 2 and reply.frame_stamp == make_observation(5).stamp_s, reply
