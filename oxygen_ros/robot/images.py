"""Camera messages -> HxWx3 uint8 RGB arrays (and back, for the simulated camera and the tests).

Nodes call one function, `image_from_msg(msg)`, for both sensor_msgs/Image and CompressedImage.
Raw images are decoded with numpy alone; cv_bridge is deliberately not used, because no version of it
gives these results under NumPy 2: the PyPI `cv_bridge` is ROS 1 code (it encodes with
`ndarray.tostring`, removed in NumPy 2); the ROS 2 one reads rows as `int(step / bytes_per_pixel)`
pixels (sheared rows when the padding is not a whole pixel), calls `ndarray.newbyteorder` (removed in
NumPy 2) on big-endian data, and scales 16 to 8 bits as round(v * 255 / 65535) rather than v >> 8.
One path here means one behaviour on every machine.
"""

from __future__ import annotations

import io
import operator
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import PIL.Image

from .errors import ImageError

MAX_SIDE = 8192  # px per side; anything larger is a corrupt header, not a camera
MAX_PIXELS = 4096 * 4096  # 16.8 MP (a 4K camera is 8.3 MP): 50 MB as RGB, checked before any decoding


@dataclass(frozen=True)
class _Layout:
    channels: int  # samples per pixel in the message
    sample_bytes: int  # 1 or 2
    rgb: tuple[int, int, int]  # the message channels that become R, G, B

    @property
    def pixel_bytes(self) -> int:
        return self.channels * self.sample_bytes


_LAYOUTS = {
    "rgb8": _Layout(3, 1, (0, 1, 2)),
    "bgr8": _Layout(3, 1, (2, 1, 0)),
    "rgba8": _Layout(4, 1, (0, 1, 2)),
    "bgra8": _Layout(4, 1, (2, 1, 0)),
    "mono8": _Layout(1, 1, (0, 0, 0)),
    "rgb16": _Layout(3, 2, (0, 1, 2)),
    "bgr16": _Layout(3, 2, (2, 1, 0)),
    "mono16": _Layout(1, 2, (0, 0, 0)),
}
SUPPORTED_ENCODINGS = tuple(_LAYOUTS)
ENCODABLE = ("rgb8", "bgr8", "rgba8", "bgra8", "mono8")


def _label(name: str | None) -> str:
    return f"image {name!r}" if name else "image"


def _as_bytes(data: Any, label: str) -> np.ndarray:
    """Flat uint8 view of a payload: bytes, bytearray, memoryview, rclpy's array.array('B'),
    a uint8 ndarray, or a list of ints."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise ImageError(f"{label}: data is a {data.dtype} array, expected uint8 bytes")
        return data.reshape(-1)
    if isinstance(data, (list, tuple)):
        try:
            return np.asarray(data, dtype=np.uint8).reshape(-1)
        except (OverflowError, TypeError, ValueError) as e:  # NumPy 2 refuses out-of-range ints
            raise ImageError(f"{label}: data is a list that is not all bytes 0..255 ({e})") from e
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise ImageError(f"{label}: data of type {type(data).__name__} is not a byte buffer") from e


def _as_int(value: Any, what: str, label: str) -> int:
    try:
        return operator.index(value)
    except TypeError as e:
        raise ImageError(f"{label}: {what} must be an integer, got {value!r}") from e


def decode_image(
    encoding: str,
    height: int,
    width: int,
    step: int,
    data: Any,
    is_bigendian: int = 0,
    *,
    name: str | None = None,
) -> np.ndarray:
    """sensor_msgs/Image fields -> new C-contiguous HxWx3 uint8 RGB array.

    Bytes past `width * bytes_per_pixel` in each row (step padding) are ignored. 16-bit samples keep
    their high byte (v >> 8); mono is replicated to three channels; alpha is dropped.
    `name` (the camera slot) only labels error messages.
    """
    label = _label(name)
    layout = _LAYOUTS.get(encoding) if isinstance(encoding, str) else None
    if layout is None:
        raise ImageError(
            f"{label}: unsupported encoding {encoding!r} (supported: {', '.join(SUPPORTED_ENCODINGS)})"
        )
    height = _as_int(height, "height", label)
    width = _as_int(width, "width", label)
    step = _as_int(step, "step", label)
    if height <= 0 or width <= 0:
        raise ImageError(f"{label}: size {width}x{height} (width x height) is empty; both must be positive")
    _check_size(width, height, label)
    row_bytes = width * layout.pixel_bytes
    if step < row_bytes:
        raise ImageError(
            f"{label}: step {step} is smaller than width {width} x {layout.pixel_bytes} bytes per pixel "
            f"= {row_bytes} for {encoding}"
        )
    buf = _as_bytes(data, label)
    if buf.size < step * height:
        raise ImageError(
            f"{label}: data has {buf.size} bytes, expected at least {step * height} "
            f"(step {step} x height {height})"
        )
    rows = buf[: step * height].reshape(height, step)[:, :row_bytes]
    if layout.sample_bytes == 2:
        # v >> 8 of a 16-bit sample is its most significant byte: the first one when big-endian.
        rows = rows[:, (0 if is_bigendian else 1) :: 2]
    pixels = rows.reshape(height, width, layout.channels)
    # Fancy indexing copies, so the result never aliases the message buffer.
    return np.ascontiguousarray(pixels[..., list(layout.rgb)])


def _check_size(width: int, height: int, label: str) -> None:
    if height > MAX_SIDE or width > MAX_SIDE:
        raise ImageError(f"{label}: size {width}x{height} exceeds the limit of {MAX_SIDE} px per side")
    if height * width > MAX_PIXELS:
        raise ImageError(f"{label}: size {width}x{height} exceeds the limit of {MAX_PIXELS} pixels")


def _header_size(buf: np.ndarray) -> tuple[int, int] | None:
    """(width, height) from a compressed image's header, without decoding a pixel; None if unreadable.
    Pillow's open() parses only the header (decoding is lazy); OpenCV has no header-only read."""
    try:
        with PIL.Image.open(io.BytesIO(buf.tobytes())) as header:
            return header.size
    except Exception:  # noqa: BLE001 - any parse failure of untrusted bytes means: not an image we read
        return None


def decode_compressed(format: str, data: Any, *, name: str | None = None) -> np.ndarray:
    """sensor_msgs/CompressedImage (jpeg, png) -> new HxWx3 uint8 RGB array.

    The size in the header is checked before decoding (a few-kB PNG can expand to gigabytes). The
    container is recognised from the bytes; `format` only labels error messages.
    """
    label = _label(name)
    buf = _as_bytes(data, label)
    described = f"format {format!r}, {buf.size} bytes"
    if buf.size == 0:
        raise ImageError(f"{label}: compressed image has no data ({described})")
    size = _header_size(buf)
    if size is None:
        raise ImageError(f"{label}: could not decode compressed image ({described})")
    _check_size(*size, label)
    try:
        bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR)  # always 8-bit, 3 channels (gray replicated)
    except cv2.error:
        bgr = None
    if bgr is None:
        raise ImageError(f"{label}: could not decode compressed image ({described})")
    if bgr.shape[1::-1] != size:  # the decoder disagrees with the header it was checked by
        raise ImageError(f"{label}: decoded size {bgr.shape[1]}x{bgr.shape[0]} differs from the header's "
                         f"{size[0]}x{size[1]} ({described})")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def image_from_msg(msg: Any, *, name: str | None = None) -> np.ndarray:
    """The one entry point for nodes: an Image or CompressedImage message -> HxWx3 uint8 RGB."""
    try:
        if hasattr(msg, "format"):
            return decode_compressed(msg.format, msg.data, name=name)
        return decode_image(
            msg.encoding, msg.height, msg.width, msg.step, msg.data, msg.is_bigendian, name=name
        )
    except AttributeError as e:
        raise ImageError(f"{_label(name)}: not an Image or CompressedImage message ({e})") from e


def encode_image(rgb: np.ndarray, encoding: str, row_padding: int = 0) -> tuple[int, bytes]:
    """HxWx3 uint8 RGB -> (step, data) for a sensor_msgs/Image; the inverse of decode_image.

    mono8 stores the luminance (exact for gray input); alpha is 255. `row_padding` extra zero
    bytes end each row, to exercise step handling.
    """
    if encoding not in ENCODABLE:
        raise ImageError(f"cannot encode {encoding!r} (supported: {', '.join(ENCODABLE)})")
    arr = np.asarray(rgb)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8 or arr.size == 0:
        raise ImageError(
            f"encode_image: expected a non-empty HxWx3 uint8 array, got shape {arr.shape} of {arr.dtype}"
        )
    if row_padding < 0:
        raise ImageError(f"encode_image: row_padding {row_padding} is negative")
    layout = _LAYOUTS[encoding]
    height, width = arr.shape[:2]
    if encoding == "mono8":
        pixels = cv2.cvtColor(np.ascontiguousarray(arr), cv2.COLOR_RGB2GRAY)
    else:
        pixels = arr[..., list(layout.rgb)]  # both channel orders are their own inverse
        if layout.channels == 4:
            alpha = np.full((height, width, 1), 255, np.uint8)
            pixels = np.concatenate([pixels, alpha], axis=2)
    rows = pixels.reshape(height, width * layout.channels)
    if row_padding:
        rows = np.pad(rows, ((0, 0), (0, row_padding)))
    return rows.shape[1], rows.tobytes()
