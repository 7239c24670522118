"""The hierarchical policy's surfaces: spatial answers in camera pixels (hand-computed), the language topics
(the right robot, frame and stamp on the right topic when the engine's listener fires; latched where they
are state), the interjection service, the subtask a chunk carries."""
from __future__ import annotations

import pytest

from oxygen_ros.model.pi052 import Located, parse_loc_answer
from oxygen_ros.nodes.language import LATCHED, TOPICS, LanguageOutbox, in_pixels


# ------------------------------------------------------------------------------------------ pixels
def test_a_point_maps_to_the_camera_image_not_to_the_padded_model_input():
    # 640 x 480 camera: the model's 224 px input has 28 px bars top and bottom, which are not part of the frame
    # the coordinates are normalised over. <loc0511> = 511/1023, <loc0767> = 767/1023.
    (item,) = in_pixels(parse_loc_answer("red cup <loc0511><loc0767>"), 640, 480)
    assert (item.label, item.kind) == ("red cup", "point")
    assert item.normalized == pytest.approx((767 / 1023, 511 / 1023))
    assert item.pixels == pytest.approx((479.8436, 239.7654), abs=1e-4)     # (767/1023*640, 511/1023*480)


def test_a_box_keeps_its_corner_order_and_a_rotated_camera_is_turned_back():
    box = Located("bowl", "box", (0.25, 0.1, 0.5, 0.4))
    (plain,) = in_pixels([box], 200, 100)
    assert plain.pixels == pytest.approx((50.0, 10.0, 100.0, 40.0))
    # The model saw the image turned 180°: its (x, y) is the camera's (W - x, H - y); x1 <= x2 kept.
    (turned,) = in_pixels([box], 200, 100, rotated_180=True)
    assert turned.pixels == pytest.approx((100.0, 60.0, 150.0, 90.0))
    assert turned.normalized == box.xy                                    # what the model wrote, unchanged
    (point,) = in_pixels([Located("p", "point", (0.25, 0.1))], 200, 100, rotated_180=True)
    assert point.pixels == pytest.approx((150.0, 90.0))


def test_an_unknown_image_size_gives_normalised_coordinates_only():
    (item,) = in_pixels([Located("cup", "point", (0.5, 0.5))], 0, 0)
    assert item.pixels == () and item.normalized == (0.5, 0.5)
    assert in_pixels([], 640, 480) == []


# ------------------------------------------------------------------------------------------ language plumbing
class Update:
    def __init__(self, robot, kind, text, frame_index=3, stamp=12.5):
        self.robot, self.kind, self.text, self.frame_index, self.stamp = robot, kind, text, frame_index, stamp


def test_the_outbox_keeps_its_robots_updates_in_order_and_wakes_the_executor():
    woken = []
    box = LanguageOutbox("arm_a", lambda: woken.append(1))
    for update in (Update("arm_b", "subtask", "other robot"), Update("arm_a", "subtask", "pick"),
                   Update("arm_a", "memory", "picked"), Update("arm_a", "unknown", "?")):
        box.put(update)
    assert [(u.kind, u.text) for u in box.take()] == [("subtask", "pick"), ("memory", "picked")]
    assert len(woken) == 2 and box.take() == []


def test_state_topics_are_latched_and_speech_is_not():
    from rclpy.qos import DurabilityPolicy

    from oxygen_ros.nodes.language import qos_for

    assert set(TOPICS) == {"subtask", "memory", "plan", "speech"}
    for kind in TOPICS:
        qos = qos_for(kind)
        assert (qos.durability == DurabilityPolicy.TRANSIENT_LOCAL) == (kind in LATCHED)
    assert "speech" not in LATCHED and qos_for("subtask").depth == 1
    assert TOPICS["memory"][1] == "oxygen/progress"          # apart from the scene captions on oxygen/memory
