import array
from types import SimpleNamespace

import cv2
import numpy as np
import pytest

from oxygen_ros.robot.errors import ImageError, InputError
from oxygen_ros.robot.images import (
    ENCODABLE,
    decode_compressed,
    decode_image,
    encode_image,
    image_from_msg,
)

RNG = np.random.default_rng(0)


def random_rgb(height=5, width=7):
    return RNG.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def gray3(height=5, width=7):
    return np.repeat(RNG.integers(0, 256, size=(height, width, 1), dtype=np.uint8), 3, axis=2)


@pytest.mark.parametrize("encoding", ENCODABLE)
@pytest.mark.parametrize("padding", [0, 1, 5])
def test_encode_decode_round_trip(encoding, padding):
    rgb = gray3() if encoding == "mono8" else random_rgb()
    step, data = encode_image(rgb, encoding, row_padding=padding)
    channels = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}[encoding]
    assert step == 7 * channels + padding
    assert len(data) == step * 5
    out = decode_image(encoding, 5, 7, step, data)
    np.testing.assert_array_equal(out, rgb)
    assert out.dtype == np.uint8 and out.flags.c_contiguous


def test_channel_orders_on_known_pixel():
    # One pixel: R=10, G=20, B=30 (alpha 40 where present).
    assert decode_image("rgb8", 1, 1, 3, bytes([10, 20, 30])).tolist() == [[[10, 20, 30]]]
    assert decode_image("bgr8", 1, 1, 3, bytes([30, 20, 10])).tolist() == [[[10, 20, 30]]]
    assert decode_image("rgba8", 1, 1, 4, bytes([10, 20, 30, 40])).tolist() == [[[10, 20, 30]]]
    assert decode_image("bgra8", 1, 1, 4, bytes([30, 20, 10, 40])).tolist() == [[[10, 20, 30]]]
    assert decode_image("mono8", 1, 1, 1, bytes([77])).tolist() == [[[77, 77, 77]]]


def test_mono8_encode_is_luminance():
    rgb = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255]]], np.uint8)
    _, data = encode_image(rgb, "mono8")
    assert list(data) == [76, 150, 29]  # 0.299, 0.587, 0.114 of 255


@pytest.mark.parametrize("big_endian", [0, 1])
@pytest.mark.parametrize("encoding,order", [("rgb16", [0, 1, 2]), ("bgr16", [2, 1, 0]), ("mono16", [0])])
def test_16_bit_keeps_high_byte(encoding, order, big_endian):
    values = RNG.integers(0, 65536, size=(4, 3, len(order)), dtype=np.uint16)
    dtype = ">u2" if big_endian else "<u2"
    padding = b"\xaa\xbb\xcc"  # odd padding: not a whole sample
    rows = [values[r].astype(dtype).tobytes() + padding for r in range(4)]
    step = len(rows[0])
    out = decode_image(encoding, 4, 3, step, b"".join(rows), is_bigendian=big_endian)
    expected = (values >> 8).astype(np.uint8)[..., order]
    if encoding == "mono16":
        expected = np.repeat(expected, 3, axis=2)
    np.testing.assert_array_equal(out, expected)


def test_extremes_of_16_bit():
    data = np.array([0, 255, 256, 65535], "<u2").tobytes()
    out = decode_image("mono16", 1, 4, 8, data)
    assert out[0, :, 0].tolist() == [0, 0, 1, 255]


def test_accepts_every_buffer_type():
    rgb = random_rgb()
    step, data = encode_image(rgb, "rgb8")
    for payload in (data, bytearray(data), memoryview(data), array.array("B", data),
                    np.frombuffer(data, np.uint8), list(data)):
        np.testing.assert_array_equal(decode_image("rgb8", 5, 7, step, payload), rgb)


def test_extra_trailing_bytes_are_ignored():
    rgb = random_rgb()
    step, data = encode_image(rgb, "rgb8")
    np.testing.assert_array_equal(decode_image("rgb8", 5, 7, step, data + b"xyz"), rgb)


def test_result_is_a_copy():
    data = bytearray(encode_image(random_rgb(), "rgb8")[1])
    out = decode_image("rgb8", 5, 7, 21, data)
    before = out.copy()
    data[:] = bytes(len(data))
    np.testing.assert_array_equal(out, before)
    assert not np.shares_memory(out, np.frombuffer(data, np.uint8))


def test_unknown_encoding_lists_supported():
    with pytest.raises(ImageError) as e:
        decode_image("yuv422", 2, 2, 4, bytes(8), name="base_0_rgb")
    assert "image 'base_0_rgb': unsupported encoding 'yuv422'" in str(e.value)
    assert "rgb8, bgr8, rgba8, bgra8, mono8, rgb16, bgr16, mono16" in str(e.value)


def test_error_is_an_input_error_and_value_error():
    with pytest.raises(InputError):
        decode_image("nope", 1, 1, 1, b"\0")
    with pytest.raises(ValueError):
        decode_image("nope", 1, 1, 1, b"\0")


@pytest.mark.parametrize("height,width", [(0, 4), (4, 0), (-1, 4)])
def test_empty_or_negative_size(height, width):
    with pytest.raises(ImageError, match=f"size {width}x{height} .* both must be positive"):
        decode_image("rgb8", height, width, 12, bytes(100))


def test_absurd_size():
    with pytest.raises(ImageError, match="size 100000x10 exceeds the limit of 8192 px per side"):
        decode_image("rgb8", 10, 100000, 300000, b"")


def test_non_integer_dimension():
    with pytest.raises(ImageError, match=r"height must be an integer, got 2\.5"):
        decode_image("rgb8", 2.5, 2, 6, bytes(12))


def test_step_too_small():
    with pytest.raises(ImageError) as e:
        decode_image("rgb8", 224, 224, 600, bytes(600 * 224), name="base_0_rgb")
    assert str(e.value) == (
        "image 'base_0_rgb': step 600 is smaller than width 224 x 3 bytes per pixel = 672 for rgb8"
    )


def test_truncated_data():
    with pytest.raises(ImageError) as e:
        decode_image("rgb8", 224, 224, 672, bytes(1000), name="base_0_rgb")
    assert str(e.value) == (
        "image 'base_0_rgb': data has 1000 bytes, expected at least 150528 (step 672 x height 224)"
    )


def test_truncated_by_one_byte():
    step, data = encode_image(random_rgb(), "bgra8", row_padding=2)
    with pytest.raises(ImageError, match=f"data has {len(data) - 1} bytes, expected at least {len(data)}"):
        decode_image("bgra8", 5, 7, step, data[:-1])


@pytest.mark.parametrize("payload,message", [
    (None, "data of type NoneType is not a byte buffer"),
    ("abc", "data of type str is not a byte buffer"),
    ([1, 2, 300], "data is a list that is not all bytes 0..255"),
    (np.zeros(12, np.float32), "data is a float32 array, expected uint8 bytes"),
])
def test_payload_of_wrong_type(payload, message):
    with pytest.raises(ImageError, match=message):
        decode_image("mono8", 1, 3, 3, payload)


@pytest.mark.parametrize("ext", [".jpg", ".png"])
def test_compressed_round_trip(ext):
    rgb = np.zeros((32, 48, 3), np.uint8)
    rgb[:, :16] = (255, 0, 0)  # flat colour blocks survive jpeg almost exactly
    rgb[:, 16:32] = (0, 255, 0)
    rgb[:, 32:] = (0, 0, 255)
    ok, encoded = cv2.imencode(ext, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok
    out = decode_compressed(ext[1:], encoded.tobytes())
    assert out.shape == (32, 48, 3) and out.dtype == np.uint8
    if ext == ".png":
        np.testing.assert_array_equal(out, rgb)
    else:
        # Red stays red: checks the BGR -> RGB swap, with room for jpeg's loss.
        assert np.abs(out[16, 8].astype(int) - [255, 0, 0]).max() < 10
        assert np.abs(out[16, 40].astype(int) - [0, 0, 255]).max() < 10


def test_compressed_gray_png_is_replicated():
    gray = RNG.integers(0, 256, size=(6, 5), dtype=np.uint8)
    _, encoded = cv2.imencode(".png", gray)
    out = decode_compressed("png", encoded)
    np.testing.assert_array_equal(out, np.repeat(gray[..., None], 3, axis=2))


def test_compressed_garbage():
    with pytest.raises(ImageError) as e:
        decode_compressed("jpeg", b"\xff\xd8 not really a jpeg" + bytes(1214), name="left_wrist_0_rgb")
    assert str(e.value) == (
        "image 'left_wrist_0_rgb': could not decode compressed image (format 'jpeg', 1234 bytes)"
    )


def test_compressed_truncated_png():
    _, encoded = cv2.imencode(".png", random_rgb(20, 20))
    with pytest.raises(ImageError, match=r"could not decode compressed image \(format 'png', 30 bytes\)"):
        decode_compressed("png", encoded.tobytes()[:30])


def test_compressed_empty():
    with pytest.raises(ImageError, match=r"compressed image has no data \(format 'jpeg', 0 bytes\)"):
        decode_compressed("jpeg", b"")


def test_image_from_msg_raw_and_compressed():
    rgb = random_rgb()
    step, data = encode_image(rgb, "bgr8", row_padding=3)
    raw = SimpleNamespace(encoding="bgr8", height=5, width=7, step=step, data=array.array("B", data),
                          is_bigendian=0)
    np.testing.assert_array_equal(image_from_msg(raw), rgb)
    _, png = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    compressed = SimpleNamespace(format="png", data=array.array("B", png.tobytes()))
    np.testing.assert_array_equal(image_from_msg(compressed), rgb)


def test_image_from_msg_with_real_messages():
    sensor_msgs = pytest.importorskip("sensor_msgs.msg")
    rgb = random_rgb()
    step, data = encode_image(rgb, "rgba8", row_padding=1)
    msg = sensor_msgs.Image(encoding="rgba8", height=5, width=7, step=step, data=data)
    np.testing.assert_array_equal(image_from_msg(msg, name="base_0_rgb"), rgb)
    msg.data = data[:10]
    with pytest.raises(ImageError, match="image 'base_0_rgb': data has 10 bytes"):
        image_from_msg(msg, name="base_0_rgb")
    _, jpg = cv2.imencode(".jpg", rgb)
    out = image_from_msg(sensor_msgs.CompressedImage(format="jpeg", data=jpg.tobytes()))
    assert out.shape == (5, 7, 3)


def test_image_from_msg_rejects_other_objects():
    with pytest.raises(ImageError, match="image 'cam': not an Image or CompressedImage message"):
        image_from_msg(SimpleNamespace(encoding="rgb8"), name="cam")


def test_encode_rejects_bad_input():
    with pytest.raises(ImageError, match="cannot encode 'rgb16'"):
        encode_image(random_rgb(), "rgb16")
    with pytest.raises(ImageError, match=r"expected a non-empty HxWx3 uint8 array, got shape \(5, 7\)"):
        encode_image(np.zeros((5, 7), np.uint8), "rgb8")
    with pytest.raises(ImageError, match="row_padding -1 is negative"):
        encode_image(random_rgb(), "rgb8", row_padding=-1)


# ----------------------------------------------------------------------------- size limits before work
def _never_decoded(monkeypatch):
    calls = []
    real = cv2.imdecode
    monkeypatch.setattr(cv2, "imdecode", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("ext", [".png", ".jpg"])
@pytest.mark.parametrize("height, width, limit", [(10, 9000, "8192 px per side"), (5000, 4000, "16777216 pixels")])
def test_compressed_size_is_checked_from_the_header_before_decoding(monkeypatch, ext, height, width, limit):
    # A few-kB PNG can expand to gigabytes: the header's size is refused before any pixel is decoded.
    ok, encoded = cv2.imencode(ext, np.zeros((height, width), np.uint8))
    assert ok and encoded.size < 2_000_000
    calls = _never_decoded(monkeypatch)
    with pytest.raises(ImageError, match=f"image 'base_0_rgb': size {width}x{height} exceeds the limit of {limit}"):
        decode_compressed(ext[1:], encoded.tobytes(), name="base_0_rgb")
    assert calls == [], "cv2.imdecode ran on an oversized image"


def test_compressed_within_the_limits_still_decodes(monkeypatch):
    rgb = random_rgb(64, 48)
    ok, encoded = cv2.imencode(".png", rgb[..., ::-1])
    calls = _never_decoded(monkeypatch)
    np.testing.assert_array_equal(decode_compressed("png", encoded.tobytes()), rgb)
    assert calls == [1]


def test_raw_image_pixel_count_is_bounded():
    # Each side within 8192 px, but 8192 x 8192 x 3 bytes = 201 MB per message (and 32 buffered per slot).
    with pytest.raises(ImageError, match="size 8192x8192 exceeds the limit of 16777216 pixels"):
        decode_image("rgb8", 8192, 8192, 8192 * 3, b"")
    assert decode_image("mono8", 2160, 3840, 3840, bytes(3840 * 2160)).shape == (2160, 3840, 3)   # 4K passes
