"""Hierarchical language in the engine (issue 38; tasks/hierarchy.py, docs/hierarchy.md): per robot a subtask
decoded from its frames by the batched decode, the actions conditioned on the newest one without waiting,
progress memory on a change of subtask, plan and speech on an interjection; the pi052 formats' KV sharing.

Numerics contract: the joint format's actions (the frame's prefix prefilled, the subtask's tokens and the
[EOS, "\\n"] block extended onto it, copied on write) equal the benchmark's serial LeRobot replica
(bench/hierarchy.py `Serial`: a prefill of its own per chunk, in the same blocks) within JOINT_TOL (float32;
measured max |diff| 0 on the CPU over 4 frames and both given subtasks, actions up to 3.0; the earlier layout,
"Assistant: {subtask}" EOS "\\n" all causal after "User: ...;\\n", misses by 0.11-1.2, and EOS blind to the
newline by 2.4e-4-2.5e-3)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import ACTION_S, PREFILL_S, SimClock, make_observation, simulate_costs, small_config
from oxygen_ros.bench.hierarchy import Serial
from oxygen_ros.engine.requests import Reply
from oxygen_ros.engine.tasks.hierarchy import LanguageUpdate
from oxygen_ros.model import pi052

JOINT_TOL = 2e-5
SPAN_S = 0.004                       # simulated cost of extending the subtask span onto a frame
H, A = 5, 8
NOISE = np.random.default_rng(0).standard_normal((H, A)).astype(np.float32)


@pytest.fixture(scope="module")
def joint_model():
    """The small model reading 64 prompt tokens: the joint frame prompt (task, 8 state bins, "Assistant:")
    is about 50, more than the small model's 48 (the engine would truncate it, cutting the header)."""
    from oxygen_ros.engine.factory import build_model

    return build_model(small_config(max_token_len=64), seed=3)


def reference_joint(engine, observation, noise, subtask=None):
    """The serial reference of a joint-format frame, without the engine: the benchmark's LeRobot replica, every
    text and every chunk on a prefill of its own in the branch's blocks (pi052.joint_tokens): the subtask
    decoded greedily after images + prompt through "Assistant:" (unless given), then images + that prompt
    (bidirectional), the subtask's tokens (causal) and [EOS, "\\n"] (one block), then the actions.
    Returns (subtask, model actions)."""
    fmt = engine.hierarchy.format
    assert fmt.masked_ranges(engine.runner.cfg.vocab_size, False) == []   # small vocabulary: greedy is plain
    serial = Serial(engine, fmt, observation.prompt)
    prepared = engine.preparer.prepare(observation)
    state = pi052.state_text(prepared.model_state)
    subtask = subtask or serial.subtask(prepared, state) or observation.prompt
    return subtask, serial.chunk(prepared, state, subtask, noise)


def test_joint_actions_equal_the_serial_lerobot_replica(engine_factory, joint_model, obs):
    """subtask_sync (the serial reference): the frame's own subtask first, then its actions read the prefix
    plus the span. Both equal the serial replica's; the span's shared tail block is copied, not written."""
    engine = engine_factory(hierarchy="joint", subtask_sync=True, subtask_every_chunks=1, subtask_period_s=0.0,
                            model=joint_model)
    writes = []
    copy_block = engine.runner.pool.copy_block
    engine.runner.pool.copy_block = lambda s, d: (writes.append((s, d)), copy_block(s, d))[1]
    for i in range(2):
        engine.run_cycle(obs(i), NOISE)
        subtask, actions = reference_joint(engine, obs(i), NOISE)
        chunk = engine.latest_chunk()
        assert chunk.subtask == subtask == engine.language_state()["subtask"]
        assert engine.language_state()["subtask_frame"] == i
        diff = float(np.abs(chunk.model_actions - actions).max())
        assert diff <= JOINT_TOL, f"joint actions differ from the serial replica's by {diff:.2e}"
    assert writes and all(s != d for s, d in writes)              # the prefix's partly filled block: copied
    plain = engine_factory(hierarchy="off", model=joint_model)
    plain.run_cycle(obs(1), NOISE)
    assert not np.allclose(plain.latest_chunk().model_actions, chunk.model_actions)
    assert plain.latest_chunk().subtask == ""
    for _ in range(400):                                          # the progress memory requests, frame-less
        if not (engine.active_requests or engine.queued_requests):
            break
        engine.run_cycle()
    assert engine.runner.pool.blocks.num_used == 0


def greedy_after(engine, images, tokens: list[int]) -> str:
    """The greedy text after images + `tokens` (all bidirectional) on a prefill of its own, as the serial
    replica decodes a text (no ids masked: the small vocabulary has none to mask)."""
    from oxygen_ros.model import inference
    from oxygen_ros.model.pi05 import PrefixRow

    model = engine.runner.model
    cache = inference.ContiguousCache(model, 4096)
    pre = inference.prefill(model, cache, [PrefixRow(images, torch.tensor(tokens))])
    ids = inference.greedy_generate(model, cache, pre.segments[0], pre.hidden[0], [],
                                    engine.hierarchy.format.max_new_tokens, eos_id=engine.tokenizer.eos_id)
    return pi052.decode_reply(engine.tokenizer, ids)


@pytest.mark.parametrize("subtask,text_prefill", [("grasp the cup", 0), ("3 cups", 1)], ids=["space", "lone-space"])
def test_a_given_subtasks_actions_equal_the_serial_lerobot_replica(engine_factory, joint_model, obs, subtask,
                                                                   text_prefill):
    """The same frame and subtask, the engine (the subtask a finished request, read by the next frame's
    actions) against the serial replica: within JOINT_TOL, whether the subtask's first piece carries its space
    or not (the lone space piece joins the actions' bidirectional block). Either way the frame's prefill is the
    actions' block and they read it: no second prefill on the chunk's path. The subtask request asked on that
    frame reads the plain prompt through "Assistant:" all the same: the frame's prefill when it is that
    prompt, else a prefill of its own of it (joint_text_own_prefill), and decodes what the replica does."""
    # A clock that stands still: the text's own prefill always fits the cycle's language time (admission)
    engine = engine_factory(hierarchy="joint", subtask_every_chunks=1, subtask_period_s=0.0, progress_memory=False,
                            decode_budget="fixed", tokens_per_frame=200, model=joint_model, clock=SimClock())
    fake = FakeSubmit(engine.tokenizer)
    engine.hierarchy.submit = fake
    engine.run_cycle(obs(0), NOISE)
    assert [r.kind for r, *_ in fake.requests] == ["subtask"]
    fake.reply(0, subtask)
    handles = []
    engine.hierarchy.submit = lambda *a, **k: (handles.append(h := engine.scheduler.submit(*a, **k)), h)[1]
    prefills = []
    prefill_one = engine.runner.prefill_one
    engine.runner.prefill_one = lambda row, *a: (prefills.append(row.tokens.tolist()), prefill_one(row, *a))[1]
    report = engine.run_cycle(obs(1), NOISE)
    chunk = engine.latest_chunk()
    assert chunk.subtask == subtask and engine.stats.counter("joint_own_prefill") == 0
    _, actions = reference_joint(engine, obs(1), NOISE, subtask)
    diff = float(np.abs(chunk.model_actions - actions).max())
    assert diff <= JOINT_TOL, f"joint actions differ from the serial replica's by {diff:.2e}"

    prepared = engine.preparer.prepare(obs(1))
    state = pi052.state_text(prepared.model_state)
    plain = engine.tokenizer.encode(pi052.joint_prompt(obs(1).prompt, state) + pi052.GENERATION_PROMPT, bos=True)
    block = pi052.joint_tokens(engine.tokenizer, obs(1).prompt, state, subtask)
    assert (block.tokens[:block.bidir] != plain) == bool(text_prefill)
    (handle,) = handles
    reply = handle.result(0)
    assert reply.success and reply.frame_index == report.frame_index
    assert engine.stats.counter("joint_text_own_prefill") == text_prefill and prefills == [plain] * text_prefill
    expected = greedy_after(engine, prepared.row.images, plain)
    assert pi052.decode_reply(engine.tokenizer, reply.tokens) == expected
    if text_prefill:      # reading the frame's prefill (the lone space piece after "Assistant:") would differ
        assert greedy_after(engine, prepared.row.images, block.tokens[:block.bidir]) != expected


def timed_engine(engine_factory, clock, **cfg):
    engine = engine_factory(clock=clock, **cfg)
    simulate_costs(engine, clock)
    extend_spans = engine.runner.extend_spans
    engine.runner.extend_spans = lambda *a: (out := extend_spans(*a), clock.advance(SPAN_S))[0]
    return engine


def test_the_chunk_never_waits_for_text(engine_factory, joint_model, obs):
    """On a simulated clock: with hierarchy on (async), every chunk costs what it costs with hierarchy off
    plus the span (prefill + span + actions, whatever the subtask requests running); the language work fits
    each cycle's deadline; the first chunks use the task (no subtask yet) and later ones the decoded subtask.
    subtask_sync, the serial reference, makes the due frames' chunks wait for their text."""
    def run(frames=20, **cfg):
        clock = SimClock()
        engine = timed_engine(engine_factory, clock, hierarchy="joint", subtask_period_s=1.0, action_rate_hz=20.0,
                              model=joint_model, **cfg)
        chunks, reports = [], []
        engine.add_chunk_listener(chunks.append)
        for i in range(frames):
            reports.append(engine.run_cycle(obs(i), NOISE))
            clock.t = max(clock.t, reports[-1].start + engine.frame_period)
        return engine, chunks, reports

    engine, chunks, reports = run()
    # A subtask whose first piece has no leading space (this random model's often do) puts the lone space
    # piece into the frame's prefill (the actions' block): the subtask request then pays a prefill of its own
    # of the plain prompt in the language time, never the chunk.
    assert {round(c.compute_s, 9) for c in chunks} == {round(PREFILL_S + SPAN_S + ACTION_S, 9)}
    assert engine.stats.counter("joint_own_prefill") == 0 and engine.stats.counter("joint_text_own_prefill")
    assert not any(r.deadline_missed for r in reports)
    subtasks = [c.subtask for c in chunks]
    assert subtasks[0] == "pick up the red cup" and engine.language_state()["subtask"] in subtasks[1:]
    asked = engine.stats.counter("submitted")
    assert 3 <= asked <= 20 * engine.frame_period / 1.0 * 2 + 2     # the 1 Hz refresh (and memory), not per frame

    _, serial, _ = run(frames=4, subtask_sync=True)
    waited = [c.compute_s for c in serial if c.compute_s > PREFILL_S + SPAN_S + ACTION_S + 1e-9]
    assert waited, "the serial reference must make a due frame's chunk wait for its subtask"


def test_each_robot_of_a_fleet_has_its_own_subtask_and_memory(joint_model):
    """Four robots, four tasks: each robot's subtask is the one decoded from its own frame (the serial
    reference of that frame), its chunks are conditioned on it, its memory is its own request's."""
    from oxygen_ros.engine.engine import EngineConfig
    from oxygen_ros.engine.factory import build_engine
    from oxygen_ros.robot.policy_io import RobotIOConfig

    names = ("a", "b", "c", "d")
    engine = build_engine(built_model=joint_model, kv_budget_mb=16.0,
                          engine=EngineConfig(hierarchy="joint", subtask_period_s=0.0, subtask_every_chunks=2,
                                              max_active_requests=8, decode_budget="fixed", tokens_per_frame=128),
                          robots={n: RobotIOConfig(robot_action_dim=7) for n in names})
    # A clock that stands still: the own prefills of texts on frames with a lone space piece always fit the
    # cycle's language time (a loaded machine's slow cycles would leave them waiting: admission)
    engine.clock = SimClock()
    updates: list[LanguageUpdate] = []
    engine.add_language_listener(updates.append)
    frame_obs = {}
    def cycle(i):
        batch = {n: make_observation(i, seed=k + 1, prompt=f"task {n} {'x' * k}") for k, n in enumerate(names)}
        report = engine.run_frames(batch, {n: NOISE for n in names})
        for k, n in enumerate(report.robots):
            frame_obs[report.frame_index + k] = batch[n]

    for i in range(30):
        cycle(i)
        if all(engine.language_state(n)["memory"] for n in names):
            break
    states = {n: engine.language_state(n) for n in names}
    cycle(30)                                           # chunks conditioned on the states read above
    for k, n in enumerate(names):
        state = states[n]
        assert state["task"] == f"task {n} {'x' * k}"
        observation = frame_obs[state["subtask_frame"]]
        assert observation.prompt == state["task"]                   # decoded from its own robot's frame
        subtask, _ = reference_joint(engine, observation, NOISE)
        assert state["subtask"] == subtask
        assert engine.latest_chunk(n).subtask == subtask
        assert state["memory"] and frame_obs[state["memory_frame"]].prompt == state["task"]
        assert {u.kind for u in updates if u.robot == n} >= {"subtask", "memory"}


class FakeSubmit:
    """Records the hierarchy task's requests; each answered by hand with `reply`."""

    def __init__(self, tokenizer):
        self.requests, self.tokenizer = [], tokenizer

    def __call__(self, request, *, question=None, own_prefix=None, masked=(), settle=None):
        from oxygen_ros.engine.requests import RequestHandle
        handle = RequestHandle(request, 0.0)
        handle._settle = settle
        self.requests.append((request, question, own_prefix, handle))
        return handle

    def reply(self, index, text, frame=7):
        self.requests[index][3]._finish(Reply(True, text, self.tokenizer.encode(text), "eos", frame_index=frame,
                                              frame_stamp=frame * 0.1))


def hierarchy_with_fake_submit(engine_factory, **cfg):
    engine = engine_factory(hierarchy="pi052", subtask_every_chunks=1, subtask_period_s=0.0, **cfg)
    fake = FakeSubmit(engine.tokenizer)
    engine.hierarchy.submit = fake
    return engine, fake


def test_memory_is_rewritten_only_when_the_subtask_changes(engine_factory, obs):
    engine, fake = hierarchy_with_fake_submit(engine_factory)
    updates = []
    engine.add_language_listener(updates.append)
    engine.run_cycle(obs(0))
    kinds = lambda: [r.kind for r, *_ in fake.requests]          # noqa: E731
    assert kinds() == ["subtask"]
    fake.reply(0, " grasp the cup ")                              # first subtask: memory with no history
    assert kinds() == ["subtask", "progress"]
    assert fake.requests[1][2] == engine.tokenizer.encode("User: pick up the red cup\nAssistant:", bos=True)
    fake.reply(1, "holding nothing yet")
    engine.run_cycle(obs(1))
    fake.reply(2, "grasp the cup")                                # the same subtask: no memory request
    assert kinds() == ["subtask", "progress", "subtask"]
    engine.run_cycle(obs(2))
    fake.reply(3, "lift the cup")
    assert kinds()[-1] == "progress"
    assert fake.requests[-1][0].text == ("User: pick up the red cup\nAssistant: Previous memory: holding nothing "
                                         "yet\nUser: Completed subtask: grasp the cup\nAssistant:")
    assert [(u.kind, u.text) for u in updates] == [("subtask", "grasp the cup"), ("memory", "holding nothing yet"),
                                                  ("subtask", "lift the cup")]
    state = engine.language_state()
    assert (state["subtask"], state["subtask_frame"], state["memory"]) == ("lift the cup", 7, "holding nothing yet")
    engine.run_cycle(obs(3))                                      # the default recipe: the subtask in the prompt
    prompt = engine.tokenizer.decode(engine.preparer.reprompt(engine.preparer.prepare(obs(3)), engine.tokenizer.encode(
        pi052.action_prompt("lift the cup", pi052.state_text(engine.preparer.prepare(obs(3)).model_state)),
        bos=True)).row.tokens.tolist())
    assert prompt.startswith("User: lift the cup, State: ") and engine.latest_chunk().subtask == "lift the cup"


def test_an_interjection_sets_plan_and_speech_before_its_reply_is_handed_out(engine_factory, obs):
    engine, fake = hierarchy_with_fake_submit(engine_factory)
    refused = engine.interject("wait")
    assert refused.result(0).finish_reason == "refused" and "no task yet" in refused.result(0).error
    engine.run_cycle(obs(0))
    seen = {}
    handle = engine.interject("put the cup on the left instead")
    handle.add_done_callback(lambda reply: seen.update(engine.language_state()))
    request, _, own_prefix, _ = fake.requests[-1]
    assert request.kind == "interjection"
    assert engine.tokenizer.decode(own_prefix) == "User: pick up the red cup\nUser: put the cup on the left " \
                                                  "instead\nAssistant:"
    fake.reply(len(fake.requests) - 1, "1. move left\n2. place <say>Sure, moving it left.</say>", frame=4)
    assert (seen["plan"], seen["speech"], seen["plan_frame"]) == ("1. move left\n2. place", "Sure, moving it left.", 4)
    engine.interject("faster")
    assert engine.tokenizer.decode(fake.requests[-1][2]).startswith(
        "User: pick up the red cup\nAssistant: Previous plan:\n1. move left\n2. place\nUser: faster")
    assert engine.interject("").result(0).finish_reason == "refused"
    assert "interjections need" in engine_factory().interject("hi").result(0).error


def test_an_interjection_is_decoded_by_the_engine(engine_factory, obs):
    """End to end on the joint format: the reply comes from the batched decode, plan and speech from it."""
    engine = engine_factory(hierarchy="joint", decode_budget="fixed", tokens_per_frame=40)
    engine.run_cycle(obs(0))
    handle = engine.interject("stop")
    for i in range(1, 10):
        if handle.done():
            break
        engine.run_cycle(obs(i))
    reply = handle.result(0)
    plan, _ = pi052.split_plan_and_say(reply.text)
    assert reply.success and engine.language_state()["plan"] == plan.strip() and plan
    assert engine.language_state()["plan_frame"] == reply.frame_index >= 1


def test_default_format_prefills_each_text_once_per_refresh(engine_factory, obs):
    """pi052's default recipe: a subtask request prefills images + "User: {task}\\nAssistant:" of its own, once
    per refresh (not per frame), after the frame's chunk; the frame's prompt then carries the subtask."""
    clock = SimClock()
    engine = timed_engine(engine_factory, clock, hierarchy="pi052", subtask_period_s=0.5, progress_memory=False,
                          action_rate_hz=20.0)
    rows = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda r, *a: (rows.append([x.tokens.tolist() for x in r]), prefill(r, *a))[1]
    chunks = []
    engine.add_chunk_listener(chunks.append)
    for i in range(20):
        start = clock.t
        engine.run_cycle(obs(i), NOISE)
        clock.t = max(clock.t, start + engine.frame_period)
    ask = engine.tokenizer.encode("User: pick up the red cup\nAssistant:", bos=True)
    own = [r for (r,) in rows if r == ask]
    assert 2 <= len(own) <= 20 * engine.frame_period / 0.5 + 1
    assert {round(c.compute_s, 9) for c in chunks} == {round(PREFILL_S + ACTION_S, 9)}
    (last,) = [r for (r,) in rows if r != ask][-1:]                 # the last frame's prompt: its subtask's
    state = pi052.state_text(engine.preparer.prepare(obs(19)).model_state)
    assert last == engine.tokenizer.encode(pi052.action_prompt(chunks[-1].subtask, state), bos=True)[:48]
    assert chunks[-1].subtask != "pick up the red cup"                # a decoded subtask, not the fallback


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), 1e9])
def test_bad_interjection_timeouts_are_refused_in_one_line(engine_factory, obs, bad):
    engine = engine_factory(hierarchy="joint")
    engine.run_cycle(obs(0))
    reply = engine.interject("stop", timeout_s=bad).result(0)
    assert reply.finish_reason == "refused" and "timeout_s" in reply.error and "\n" not in reply.error
