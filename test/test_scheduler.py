"""The frame cycle's scheduling on a simulated clock: deadline budget, actions first, fairness,
cancellation, timeouts, stale frames, bounded queue. The model really runs (a small one); only the
engine's notion of time is simulated: each runner operation advances the clock by a fixed cost."""
import numpy as np
import pytest

from conftest import ACTION_S, PREFILL_S, SimClock, decode_cost, simulate_costs
from oxygen_ros.engine.requests import TextRequest
from oxygen_ros.engine.scheduler import ForwardCost, LanguageBudget

def test_decode_budget_rules():
    fixed = LanguageBudget("fixed", tokens_per_frame=5, min_steps=1, chunk_tokens=64)
    assert [fixed.another_step(s, 0.0, -1.0, 4) for s in range(6)] == [True] * 5 + [False]
    assert fixed.prefill_tokens(0.0, -1.0, 4, [50, 50]) == [50, 14]                 # fixed: the chunk, always
    dl = LanguageBudget("deadline", tokens_per_frame=5, min_steps=2, chunk_tokens=64)
    assert dl.another_step(0, now=10.0, deadline=9.0, batch=3)      # minimum progress even when late
    assert dl.another_step(1, now=10.0, deadline=9.0, batch=3)
    assert not dl.another_step(2, now=10.0, deadline=9.0, batch=3)
    assert dl.prefill_tokens(0.0, 1.0, 0, [100]) == [64]                          # unmeasured: the minimum
    assert dl.prefill_tokens(5.0, 1.0, 0, [100]) == [64]                          # late: the minimum
    dl.observe(3, 3, 0.2)
    assert dl.cost.step(3) == pytest.approx(0.2)
    dl.observe(3, 3, 0.1)
    assert dl.cost.step(3) == pytest.approx(0.2 + 0.3 * (0.1 - 0.2))             # moving average per batch
    assert dl.another_step(2, now=1.0, deadline=1.17, batch=3)
    assert not dl.another_step(2, now=1.0, deadline=1.16, batch=3)
    zero = LanguageBudget("deadline", tokens_per_frame=5, min_steps=0, chunk_tokens=64)
    zero.observe(3, 3, 0.2)
    assert not zero.another_step(0, now=1.0, deadline=1.0, batch=3)               # a frame cycle: min_steps 0
    assert zero.another_step(0, now=1.0, deadline=1.0, batch=3, frame=False)       # without a frame: one step
    assert not zero.another_step(1, now=1.0, deadline=1.0, batch=3, frame=False)
    with pytest.raises(ValueError):
        LanguageBudget("eager", 1, 1, 64)


def test_the_cost_model_learns_a_forward_from_decode_steps_and_question_prefills():
    """time = a + b x rows + c x tokens, from what the forwards measured: question prefills make the token
    cost identifiable; an unmeasured batch size is predicted from the fit, not from its nearest neighbour."""
    budget = LanguageBudget("deadline", tokens_per_frame=5, min_steps=1, chunk_tokens=16)
    cost = lambda rows, tokens: 0.010 + 0.002 * rows + 0.0005 * tokens             # noqa: E731
    for rows, tokens in [(1, 1), (4, 4), (8, 8), (2, 150), (3, 300), (1, 64)]:
        budget.observe(rows, tokens, cost(rows, tokens))
    assert budget.cost.step(20) == pytest.approx(cost(20, 20))
    assert budget.cost.forward(5, 500) == pytest.approx(cost(5, 500))
    # 0.2001 s left, one decode step of 8 rows after it (0.03 s): the questions' tokens, counted over the rows
    # that get some. Two questions of 500 tokens: the first alone gets them all, a forward of ONE row.
    left = 0.2001 - cost(8, 8)
    (alone,) = budget.prefill_tokens(0.0, 0.2001, 8, [500, 500])
    assert cost(1, alone) <= left < cost(1, alone + 1)
    first, second = budget.prefill_tokens(0.0, 0.2001, 8, [100, 500])            # two rows: 100 + the rest
    assert first == 100 and cost(2, 100 + second) <= left - cost(9, 9) + cost(8, 8) < cost(2, 101 + second)
    # a question the forward completes decodes in the step after it: that step has one row more
    (short,) = budget.prefill_tokens(0.0, 0.2001, 8, [300])
    assert short == 300 and cost(1, 300) + cost(9, 9) <= 0.2001
    (edge,) = budget.prefill_tokens(0.0, 0.2001, 8, [316])       # 316 tokens fit, not with a 9-row step after
    assert cost(1, 316) + cost(8, 8) <= 0.2001 < cost(1, 316) + cost(9, 9) and edge == 315
    assert budget.prefill_tokens(0.0, 0.02, 8, [100, 100]) == [16]                 # the minimum when nothing fits
    assert budget.prefill_tokens(0.0, 0.02, 8, [10, 100]) == [10, 6]


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_tokens_within_is_the_largest_count_that_fits_exactly(rows):
    """Not one token more (rounding up would overrun the deadline by a token's time), not one fewer."""
    budget = LanguageBudget("deadline", tokens_per_frame=5, min_steps=0, chunk_tokens=1)
    cost = lambda r, t: 0.004 + 0.001 * r + 0.00025 * t             # noqa: E731 - 1/4 ms a token
    for r, t in [(1, 1), (2, 2), (1, 40), (2, 100), (4, 300)]:
        budget.observe(r, t, cost(r, t))
    for seconds in (0.05011, 0.0513, 0.09996, 0.30011):              # none on a token boundary
        n = budget.cost.tokens_within(seconds, rows)
        assert cost(rows, n) <= seconds < cost(rows, n + 1), (seconds, n)
    assert budget.cost.tokens_within(0.001, rows) == 0                   # not even the rows fit


def test_the_cost_model_never_goes_negative_and_keeps_predicting():
    """A forward faster than linear (CPU prefills: 64 tokens cost barely more than 8) made the unconstrained
    fit's intercept or row cost negative; the fit was then discarded, every prediction fell back to nothing
    and a cycle without a frame prefilled nothing, measured nothing, and never recovered (issue 33). The fit
    is non-negative (least squares under that constraint, checked against a brute-force grid) and used."""
    budget = LanguageBudget("deadline", tokens_per_frame=5, min_steps=1, chunk_tokens=64)
    measured = [(1, 1, 0.023), (1, 64, 0.044), (1, 512, 0.088), (4, 512, 0.080), (8, 8, 0.026), (16, 16, 0.027),
                (2, 128, 0.052)]
    for rows, tokens, seconds in measured:
        budget.observe(rows, tokens, seconds)
    a, b, c = budget.cost.coefficients
    assert min(a, b, c) >= 0 and c > 0
    unconstrained = np.linalg.lstsq(np.array([(1, r, t) for r, t, _ in measured], float),
                                     np.array([s for *_, s in measured]), rcond=None)[0]
    assert unconstrained.min() < 0                          # the case the issue saw
    # the constrained optimum, independently: a grid over (b, c) >= 0, with a's best value for each
    x = np.array([(r, t) for r, t, _ in measured], float)
    y = np.array([s for *_, s in measured])
    best = np.inf
    for gb in np.linspace(0, 0.001, 201):
        for gc in np.linspace(0, 0.0002, 201):
            rest = y - x @ (gb, gc)
            best = min(best, float(np.sum((rest - max(rest.mean(), 0.0)) ** 2)))
    fitted = float(np.sum((np.array([(1, r, t) for r, t, _ in measured]) @ (a, b, c) - y) ** 2))
    assert fitted <= best + 1e-12
    # a frame period of 0.1 s left, 5 questions of 1,500 tokens waiting: the fit says many tokens fit
    assert sum(budget.prefill_tokens(0.0, 0.1, 0, [1500] * 5)) > 64


def test_deadline_budget_fills_the_frame_period_and_no_more(engine_factory, obs):
    clock = SimClock()
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="deadline", action_rate_hz=25.0,
                            min_tokens_per_frame=1)
    simulate_costs(engine, clock)
    period = engine.frame_period                                      # 5 rows at 25 Hz = 0.2 s
    assert period == pytest.approx(0.2)
    handles = [engine.submit(TextRequest("what is on the table?", max_tokens=60)) for _ in range(3)]
    engine.run_cycle(obs(0))                                          # learns the step time
    report = engine.run_cycle(obs(1))
    step = decode_cost(3)
    expected = int((period - PREFILL_S - ACTION_S) // step)
    assert report.decode_steps == expected
    assert report.duration_s <= period + 1e-9 and not report.deadline_missed
    for h in handles:
        h.cancel()
    engine.run_cycle(None)


def test_the_deadline_budget_predicts_each_step_at_its_batch_size(engine_factory, obs):
    """A step of 20 rows costs 0.05 s, one of 1 row 0.012 s: predicting a big batch's step from the batch-1
    time would start a step the deadline cannot hold. 19 questions arriving at once are prefilled in chunks
    over the cycles (133 question tokens do not fit one cycle beside the frame and a decode step)."""
    clock = SimClock()
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="deadline", action_rate_hz=25.0,
                            min_tokens_per_frame=1, ignore_eos=True, max_queued_per_owner=32)
    simulate_costs(engine, clock)
    question = len(engine.question_tokens("what is on the table?"))
    handles = [engine.submit(TextRequest("what is on the table?", max_tokens=200))]
    engine.run_cycle(obs(0))                                          # learns the batch-1 step time
    handles += [engine.submit(TextRequest("what is on the table?", max_tokens=200)) for _ in range(19)]
    reports = [engine.run_cycle(obs(i)) for i in range(1, 5)]
    assert not any(r.deadline_missed for r in reports), reports
    assert [r.question_tokens for r in reports][0] < 19 * question            # spread over cycles...
    assert sum(r.question_tokens for r in reports) == 19 * question          # ...and all prefilled
    assert reports[-1].batch_sizes == [20, 20]     # 0.07 s of frame, two steps of 0.05 s; a third ends at 0.22 s
    for h in handles:
        h.cancel()
    engine.run_cycle(None)


def test_minimum_progress_when_the_frame_is_already_late(engine_factory, obs):
    clock = SimClock()
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="deadline", action_rate_hz=100.0,
                            min_tokens_per_frame=2)
    simulate_costs(engine, clock)
    engine.submit(TextRequest("what is on the table?", max_tokens=40))
    report = engine.run_cycle(obs(0))                                 # prefill + action alone exceed 0.05 s
    assert report.decode_steps == 2
    assert report.deadline_missed
    assert engine.stats.snapshot()["deadline_misses"] == 1


def test_action_chunk_comes_before_any_language_work(engine_factory, obs):
    clock, calls = SimClock(), []
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="fixed", tokens_per_frame=3)
    simulate_costs(engine, clock, calls)
    seen = []
    engine.add_chunk_listener(lambda chunk: seen.append(list(calls)))
    engine.submit(TextRequest("what is on the table?", max_tokens=10))
    engine.run_cycle(obs(0))
    assert seen == [["prefill", "actions"]], "the chunk is published before any text work"
    assert calls[:2] == ["prefill", "actions"] and calls[2:] == ["extend"] * 4   # question + 3 steps
    chunk = engine.latest_chunk()
    assert chunk.plan.actions.shape == (5, 7) and chunk.plan.stamp_s == obs(0).stamp_s
    assert chunk.plan.step_period_s == pytest.approx(1 / 70)


def test_fairness_every_active_request_advances_each_step(engine_factory, obs):
    engine = engine_factory(policy="oxygen", decode_budget="fixed", tokens_per_frame=4, max_active_requests=2)
    handles = [engine.submit(TextRequest(f"question number {i}", max_tokens=30)) for i in range(3)]
    engine.run_cycle(obs(0))
    active = list(engine.scheduler.running)
    assert [r.handle for r in active] == handles[:2], "first come, first admitted"
    assert engine.queued_requests == 1
    assert [len(r.tokens) for r in active] == [5, 5]                 # first token + 4 steps each
    for h in handles:
        h.cancel()
    engine.run_cycle(obs(1))
    assert all(h.result(0).finish_reason == "cancelled" for h in handles)


def test_cancel_and_timeout_release_their_blocks(engine_factory, obs):
    clock = SimClock()
    engine = engine_factory(clock=clock, policy="oxygen", decode_budget="fixed", tokens_per_frame=2)
    pool = engine.runner.pool
    a = engine.submit(TextRequest("what is on the table?", max_tokens=50))
    b = engine.submit(TextRequest("what is on the table?", max_tokens=50, timeout_s=1.0))
    engine.run_cycle(obs(0))
    assert engine.active_requests == 2
    a.cancel()
    clock.advance(1.5)
    queued = engine.submit(TextRequest("never admitted", max_tokens=5))
    queued.cancel()
    engine.run_cycle(None)
    ra, rb, rq = a.result(0), b.result(0), queued.result(0)
    assert (ra.finish_reason, rb.finish_reason, rq.finish_reason) == ("cancelled", "timeout", "cancelled")
    assert not ra.success and "timed out after 1 s" in rb.error and rb.tokens
    assert pool.blocks.num_used == 0


def test_only_the_newest_observation_is_processed(engine_factory, obs):
    engine = engine_factory(policy="oxygen")
    for i in range(4):
        engine.submit_observation(obs(i))
    report = engine.run_frames()               # what the engine thread does: take the pending observation
    assert report.robots == [""] and report.chunks == 1
    assert engine.latest_chunk().plan.stamp_s == obs(3).stamp_s
    assert engine.stats.snapshot()["dropped_frames"] == 3


def test_bounded_queue_refuses_with_a_reason(engine_factory):
    engine = engine_factory(max_queued_requests=3)
    handles = [engine.submit(TextRequest("hello there", max_tokens=4)) for _ in range(5)]
    assert [h.done() for h in handles] == [False, False, False, True, True]
    r = handles[-1].result(0)
    assert not r.success and r.finish_reason == "refused" and r.error.startswith("busy: 3 requests already waiting")
    assert engine.stats.counter("refused_busy") == 2


def test_invalid_requests_are_refused_precisely(engine_factory):
    engine = engine_factory(max_question_chars=50)
    cases = {"": "question is empty", "x" * 60: "question has 60 characters, the limit is 50"}
    for text, message in cases.items():
        r = engine.submit(TextRequest(text)).result(0)
        assert not r.success and message in r.error
    r = engine.submit(TextRequest("fine", max_tokens=10_000)).result(0)
    assert "max_tokens must be in 1..256" in r.error
    assert engine.queued_requests == 0


def test_decode_steps_never_push_the_prefills_out_of_the_cost_model():
    """The cost model keeps decode steps and question prefills in windows of their own: a run of decode steps
    longer than the window leaves the prefills that make the token cost identifiable (one shared window:
    only rows = tokens points remain, the row and token costs cannot be told apart, and the fit shares them
    out wrongly)."""
    cost = ForwardCost(window=8)
    f = lambda rows, tokens: 0.010 + 0.002 * rows + 0.0005 * tokens             # noqa: E731
    for rows, tokens in [(1, 64), (2, 150)]:
        cost.observe(rows, tokens, f(rows, tokens))
    for _ in range(100):
        for batch in (1, 4):
            cost.observe(batch, batch, f(batch, batch))
    assert cost.coefficients == pytest.approx((0.010, 0.002, 0.0005), rel=1e-6)
    assert cost.tokens_within(f(1, 200) + 1e-12, 1) == 200
