import numpy as np
import pytest

from oxygen_ros.robot.errors import ConfigError, SyncError
from oxygen_ros.robot.sync import ObservationAssembler

SLOTS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]
BASE, LEFT, RIGHT = SLOTS


def image(tag=0):
    return np.full((2, 2, 3), tag, np.uint8)


def state(value=0.0):
    return np.full(3, value, np.float64)


def assembler(**kw):
    args = dict(slots=SLOTS, required_slots={BASE}, slop_s=0.02, missing_after_s=0.5, buffer=4)
    return ObservationAssembler(**{**args, **kw})


def test_pairs_the_nearest_image_within_slop():
    asm = assembler()
    picked = image(2)
    for stamp, im in [(0.95, image(1)), (0.99, picked), (1.03, image(3))]:
        asm.add_image(BASE, stamp, im)
    asm.add_image(LEFT, 1.01, image(4))
    asm.add_image(RIGHT, 0.985, image(5))
    asm.add_state(1.0, state(7))
    obs = asm.poll(now_s=1.05)
    assert obs is not None
    assert obs.stamp_s == 1.0
    assert list(obs.images) == SLOTS and list(obs.image_masks) == SLOTS
    assert obs.images[BASE] is picked
    assert obs.images[LEFT][0, 0, 0] == 4 and obs.images[RIGHT][0, 0, 0] == 5
    assert obs.image_masks == {BASE: True, LEFT: True, RIGHT: True}
    assert obs.state.tolist() == [7, 7, 7]
    assert obs.prompt == ""


def test_no_state_no_observation():
    asm = assembler()
    asm.add_image(BASE, 1.0, image())
    assert asm.poll(1.0) is None


def test_required_slot_waits_for_an_image_within_slop():
    asm = assembler(required_slots=set(SLOTS))
    asm.add_state(1.0, state())
    asm.add_image(LEFT, 1.0, image())
    asm.add_image(RIGHT, 1.0, image())
    assert asm.poll(1.0) is None  # no base image at all
    asm.add_image(BASE, 1.021, image())
    assert asm.poll(5.0) is None  # just outside slop; a required slot is never masked
    asm.add_image(BASE, 1.02, image(9))  # exactly at slop pairs
    obs = asm.poll(5.0)
    assert obs is not None and obs.images[BASE][0, 0, 0] == 9


def test_optional_slot_waits_then_is_masked_when_its_camera_stops():
    asm = assembler()
    asm.add_image(RIGHT, 0.0, image())  # the right wrist camera's last frame
    asm.add_image(BASE, 1.0, image())
    asm.add_image(LEFT, 1.0, image())
    asm.add_state(1.0, state())
    assert asm.poll(now_s=0.45) is None  # newest right image only 0.45 s old: it may still come
    assert asm.poll(now_s=0.5) is None  # exactly missing_after: still waiting
    obs = asm.poll(now_s=0.55)
    assert obs is not None
    assert obs.images[RIGHT] is None
    assert obs.image_masks == {BASE: True, LEFT: True, RIGHT: False}
    assert asm.stats["slots_masked"] == 1


def test_never_seen_optional_slot_is_masked_after_the_grace_from_the_first_poll():
    asm = assembler()
    asm.add_image(BASE, 10.0, image())
    asm.add_image(LEFT, 10.0, image())
    asm.add_state(10.0, state())
    assert asm.poll(10.0) is None
    assert asm.poll(10.4) is None
    obs = asm.poll(10.51)
    assert obs.image_masks[RIGHT] is False


def test_camera_that_comes_back_is_paired_again():
    asm = assembler(required_slots={BASE})
    asm.add_image(RIGHT, 0.5, image())
    asm.add_image(BASE, 1.0, image())
    asm.add_image(LEFT, 1.0, image())
    asm.add_state(1.0, state())
    assert asm.poll(2.0).image_masks[RIGHT] is False
    asm.add_image(BASE, 2.0, image())
    asm.add_image(LEFT, 2.0, image())
    asm.add_image(RIGHT, 2.01, image())
    asm.add_state(2.0, state())
    assert asm.poll(2.02).image_masks == {BASE: True, LEFT: True, RIGHT: True}


def test_each_state_is_emitted_once():
    asm = assembler()
    for slot in SLOTS:
        asm.add_image(slot, 1.0, image())
    asm.add_state(1.0, state())
    assert asm.poll(1.0) is not None
    assert asm.poll(1.0) is None
    assert asm.poll(1.5) is None
    asm.add_state(1.0, state())  # the same stamp again: already emitted
    assert asm.poll(1.5) is None
    asm.add_state(1.01, state())  # a new state pairs with the same images
    obs = asm.poll(1.02)
    assert obs.stamp_s == 1.01
    assert asm.stats["observations"] == 2
    assert asm.stats["states_dropped"] == 1


def test_newest_state_that_can_be_completed_wins_when_cameras_lag():
    # 100 Hz state, a camera whose frames arrive after newer states: waiting on the newest state
    # alone would never emit.
    asm = assembler(slop_s=0.004, buffer=16, required_slots=set(SLOTS))
    for i in range(11):
        asm.add_state(1.0 + i * 0.01, state(i))  # 1.00 .. 1.10
    for slot in SLOTS:
        asm.add_image(slot, 1.021, image())
    obs = asm.poll(1.1)
    assert obs.stamp_s == pytest.approx(1.02) and obs.state[0] == 2
    assert asm.stats["states_dropped"] == 2  # 1.00 and 1.01 can no longer be pivots
    assert asm.poll(1.1) is None
    for slot in SLOTS:
        asm.add_image(slot, 1.061, image())
    obs = asm.poll(1.11)
    assert obs.stamp_s == pytest.approx(1.06) and obs.state[0] == 6
    assert asm.stats["states_dropped"] == 5


def test_newest_pivot_preferred_when_several_complete():
    asm = assembler(buffer=8)
    for stamp in (1.0, 1.1, 1.2):
        for slot in SLOTS:
            asm.add_image(slot, stamp, image())
        asm.add_state(stamp, state(stamp))
    assert asm.poll(1.2).stamp_s == 1.2
    assert asm.poll(1.2) is None  # older ones are dropped, not emitted late
    assert asm.stats["states_dropped"] == 2


def test_prompt_is_attached():
    asm = assembler()
    asm.set_prompt("pick up the red cup")
    for slot in SLOTS:
        asm.add_image(slot, 1.0, image())
    asm.add_state(1.0, state())
    assert asm.poll(1.0).prompt == "pick up the red cup"


def test_buffers_are_bounded_and_evictions_counted():
    asm = assembler(slots=[BASE], buffer=4)
    for i in range(10):
        asm.add_image(BASE, i * 0.1, image(i))
        asm.add_state(i * 0.1 - 0.05, state(i))  # 50 ms off: never within slop
    assert len(asm._images[BASE]) == 4 and len(asm._states) == 4
    assert asm.stats["images_dropped"] == 6 and asm.stats["states_dropped"] == 6
    asm.add_state(0.001, state())
    assert asm.stats["states_dropped"] == 7  # older than the newest buffered state: out of order
    asm.add_state(0.905, state())  # pairs with the image at 0.9, still buffered
    assert asm.poll(1.0).images[BASE][0, 0, 0] == 9


def test_inputs_too_old_for_any_future_pivot_are_dropped():
    asm = assembler()
    for slot in SLOTS:
        asm.add_image(slot, 1.0, image())
    asm.add_state(1.0, state())
    assert asm.poll(1.0) is not None
    dropped = asm.stats["images_dropped"]
    asm.add_image(BASE, 0.97, image())  # < 1.0 - slop
    assert asm.stats["images_dropped"] == dropped + 1
    asm.add_image(BASE, 0.99, image())  # still within slop of a state just after 1.0
    assert asm.stats["images_dropped"] == dropped + 1
    asm.add_state(0.99, state())
    assert asm.stats["states_dropped"] == 1


def test_simulated_robot_stream():
    # 100 Hz state; three hardware-synced cameras at 25 Hz (every 4th state tick) whose frames
    # arrive 30, 45 and 20 ms after capture; polled after every input, on a simulated clock.
    asm = ObservationAssembler(SLOTS, {BASE}, slop_s=0.005, missing_after_s=0.5, buffer=16)
    latency = {BASE: 0.030, LEFT: 0.045, RIGHT: 0.020}
    events = []  # (arrival time, kind, slot, stamp, frame)
    for tick in range(200):
        t = tick * 0.01
        events.append((t, "state", None, t, tick))
        if tick % 4 == 0:
            for slot, lag in latency.items():
                events.append((t + lag, "image", slot, t, tick))
    observations = []
    for arrival, kind, slot, stamp, tick in sorted(events, key=lambda e: (e[0], e[1] == "state")):
        if kind == "state":
            asm.add_state(stamp, state(tick))
        else:
            asm.add_image(slot, stamp, image(tick % 256))
        obs = asm.poll(arrival)
        if obs is not None:
            observations.append(obs)
    stamps = [o.stamp_s for o in observations]
    assert stamps == sorted(set(stamps))  # increasing, no duplicates
    assert len(observations) == 200 // 4  # one per camera frame
    for obs in observations:
        tick = int(obs.state[0])
        assert tick % 4 == 0  # paired with the state taken with the frame
        assert all(obs.images[s][0, 0, 0] == tick % 256 for s in SLOTS)
        assert all(obs.image_masks.values())
    assert asm.stats["observations"] == len(observations)
    assert asm.stats["images_dropped"] == 0


def test_unknown_slot():
    with pytest.raises(SyncError) as e:
        assembler().add_image("top_0_rgb", 1.0, image())
    assert str(e.value) == (
        "unknown camera slot 'top_0_rgb' (slots: base_0_rgb, left_wrist_0_rgb, right_wrist_0_rgb)"
    )


def test_bad_inputs():
    asm = assembler()
    with pytest.raises(SyncError, match="image 'base_0_rgb': stamp nan is not finite"):
        asm.add_image(BASE, float("nan"), image())
    with pytest.raises(SyncError, match=r"image 'base_0_rgb': expected an HxWx3 uint8 array, got shape"):
        asm.add_image(BASE, 1.0, np.zeros((2, 2), np.uint8))
    with pytest.raises(SyncError, match="state: stamp inf is not finite"):
        asm.add_state(float("inf"), state())
    with pytest.raises(SyncError, match="state: expected a 1-D float64 array, got list"):
        asm.add_state(1.0, [1.0, 2.0])
    with pytest.raises(SyncError, match="now: stamp 'x' is not a number"):
        asm.poll("x")
    with pytest.raises(SyncError, match="prompt must be str, got bytes"):
        asm.set_prompt(b"hi")
    assert asm.stats["images_received"] == 0 and asm.stats["states_received"] == 0


def test_config_errors():
    with pytest.raises(ConfigError, match=r"required slots \['top'\] are not camera slots"):
        assembler(required_slots={"top"})
    with pytest.raises(ConfigError, match="contain a duplicate"):
        assembler(slots=[BASE, BASE])
    with pytest.raises(ConfigError, match="no camera slots"):
        assembler(slots=[], required_slots=set())
    with pytest.raises(ConfigError, match="must be >= 0"):
        assembler(slop_s=float("nan"))
    with pytest.raises(ConfigError, match="buffer 0 must be at least 1"):
        assembler(buffer=0)


def test_image_buffer_is_bounded_in_bytes_too():
    # 32 buffered 4K frames per slot would be 800 MB: the byte budget keeps the newest that fit (at least one).
    big = np.zeros((100, 100, 3), np.uint8)                       # 30,000 bytes
    asm = assembler(slots=[BASE], buffer=32, max_image_bytes=100_000)
    for i in range(10):
        asm.add_image(BASE, i * 0.1, big)
    assert [im.stamp_s for im in asm._images[BASE]] == pytest.approx([0.7, 0.8, 0.9])
    assert asm.stats["images_dropped"] == 7
    asm.add_image(BASE, 1.0, np.zeros((200, 200, 3), np.uint8))  # alone above the budget: still kept
    assert [im.stamp_s for im in asm._images[BASE]] == [1.0]
    asm.add_state(1.0, state())
    assert asm.poll(1.0) is not None
    with pytest.raises(ConfigError, match="max_image_bytes 0 must be positive"):
        assembler(max_image_bytes=0)
