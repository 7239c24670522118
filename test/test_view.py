"""The debug picture and the chunk markers (no ROS graph): projection of the end-effector path through
a calibrated pinhole camera (to 1e-9 px), the joint-target strip, the reply text, the markers."""
import numpy as np
import pytest

from oxygen_ros.view.overlay import LANE, WIDTH, Camera, joint_strip, render
from oxygen_ros.view.view_node import chunk_markers


def looking_down(height=1.0):
    """A camera `height` m above the base origin looking straight down: optical z = -base z, x = base x,
    y = -base y (quaternion x, y, z, w of a 180 degree turn about x)."""
    return Camera.from_params([200.0, 200.0, 112.0, 112.0], [0.0, 0.0, height, 1.0, 0.0, 0.0, 0.0])


def test_projection_is_the_pinhole_model():
    cam = looking_down()
    pts = np.array([[0.0, 0.0, 0.0], [0.1, 0.0, 0.0], [0.0, 0.1, 0.5], [0.0, 0.0, 2.0]])
    px, front = cam.project(pts)
    np.testing.assert_allclose(px[0], [112.0, 112.0], atol=1e-9)           # straight below: the centre
    np.testing.assert_allclose(px[1], [112.0 + 200.0 * 0.1, 112.0], atol=1e-9)
    np.testing.assert_allclose(px[2], [112.0, 112.0 - 200.0 * 0.1 / 0.5], atol=1e-9)
    assert front.tolist() == [True, True, True, False]                       # above the camera: behind it


def test_bad_calibration_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="intrinsics"):
        Camera.from_params([1.0, 2.0], [0, 0, 0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="not a rotation"):
        Camera.from_params([1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0])


def test_path_is_drawn_where_it_projects():
    image = np.zeros((224, 224, 3), np.uint8)
    path = np.zeros((10, 7))
    path[:, 0] = np.linspace(0.0, 0.2, 10)              # along base x: a horizontal line right of centre
    out = render(image, path, camera=looking_down(), ee_path=True)
    assert out.shape[1] == WIDTH and out.shape[0] == 448    # no strip under it, no reply
    row = out[224, :]                                   # the image row of the centre (scaled x2)
    lit = np.flatnonzero(row.max(axis=1) > 100)
    assert lit.min() <= 228 and lit.max() >= 2 * (112 + 40) - 6   # from the centre to x = 0.2 m (40 px x2)
    assert out[100:120].max() == 0                      # nothing drawn elsewhere


def test_joint_strip_has_a_lane_per_dimension_and_the_reply_is_written():
    actions = np.tile(np.linspace(-1.0, 1.0, 20)[:, None], (1, 7))
    strip = joint_strip(actions, [f"j{i}" for i in range(7)], -np.ones(7), np.ones(7))
    assert strip.shape == (7 * LANE, WIDTH, 3)
    lane = strip[:LANE, 80:]                            # a rising line: lit low on the left, high on the right
    rows_left = np.flatnonzero(lane[:, 2, 2] > 150)      # blue channel of the line, near its start
    rows_right = np.flatnonzero(lane[:, 350, 2] > 150)   # and near its end
    assert rows_left.size and rows_right.size and rows_left.mean() > rows_right.mean() + 6
    out = render(np.zeros((224, 224, 3), np.uint8), actions, names=["j"] * 7, reply="Q: hi  A: héllo\nthere")
    assert out.shape == (448 + 7 * LANE + 22, WIDTH, 3)


def test_markers_follow_the_chunk():
    actions = np.arange(30, dtype=np.float64).reshape(10, 3)
    m = chunk_markers(actions, 12.5, "base_link")
    assert [x.type for x in m.markers] == [4, 7]        # LINE_STRIP, SPHERE_LIST
    strip = m.markers[0]
    assert strip.header.frame_id == "base_link" and strip.header.stamp.sec == 12
    assert [(p.x, p.y, p.z) for p in strip.points] == [tuple(r) for r in actions.tolist()]
    assert strip.colors[0].g == 1.0 and strip.colors[-1].r == 1.0
