"""Untrusted image bytes -> validated RGB image, plus a content hash.

Host code only (Pillow), never traced. Two stages (the ports of HF image processors that turn the
RGB image into model pixels live apart, in `mmjax.image.processors`):

1. `load_image`: decode untrusted input (bytes, data URI, local path or a PIL image) with byte and
   pixel limits checked *before* the full decode, take the first frame of animations, apply EXIF
   orientation and convert to RGB exactly like transformers' `convert_to_rgb` (transparency
   composited on white).
2. `pixel_hash`: sha256 of the decoded pixels, the key for the encoder cache (format independent).
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import os
import re
import struct
import threading
import warnings
from dataclasses import dataclass
from typing import Iterator, Union

from PIL import Image, ImageOps, UnidentifiedImageError

from mmjax.errors import ImageError, ImageTooLargeError

__all__ = ["ImageLimits", "ImageSource", "decode_data_uri", "load_image", "pixel_hash", "to_rgb"]

ImageSource = Union[bytes, bytearray, memoryview, Image.Image, str, os.PathLike]

PARAM = "image_url"  # the OpenAI request field every image error points at

# Raster formats a chat client plausibly sends. Everything else Pillow can open (EPS, which shells
# out to Ghostscript, PSD, ICNS, fonts, ...) is refused: more decoders = more attack surface.
# (MPO, the multi-picture JPEG of phone cameras, is opened by the JPEG plugin.)
DEFAULT_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF", "AVIF")

# Leading bytes of the accepted formats: lets a corrupt header be reported as corrupt rather than
# as an unsupported format (Pillow raises the same UnidentifiedImageError for both).
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageLimits:
    """Limits on one input image.

    max_bytes: encoded size. max_pixels: decoded width*height, checked from the header before the
    full decode (decompression-bomb guard). Pillow's own guard (`Image.MAX_IMAGE_PIXELS`, ~89 MP)
    also applies, so the effective pixel limit is the smaller of the two.
    formats: Pillow format names accepted (others -> ImageError).
    """

    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000
    formats: tuple[str, ...] = DEFAULT_FORMATS

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_pixels <= 0:
            raise ValueError(f"ImageLimits must be positive, got max_bytes={self.max_bytes}, "
                             f"max_pixels={self.max_pixels}")


_WHITESPACE = re.compile(r"\s+")


def _strip_whitespace(text: str) -> str:
    # Clients wrap long base64 at 76 columns (MIME style); whitespace is never data.
    return _WHITESPACE.sub("", text) if _WHITESPACE.search(text) else text


def _split_data_uri(uri: str) -> tuple[str, str]:
    """'data:image/png;base64,AAAA' -> ('image/png', 'AAAA'); ImageError if not an image data URI."""
    if not isinstance(uri, str) or not uri[:5].lower() == "data:":
        raise ImageError("image data URI must start with 'data:'", param=PARAM)
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise ImageError("malformed data URI: no ',' between header and data", param=PARAM)
    parts = [p.strip().lower() for p in header.split(";")]
    media_type = parts[0]
    if not media_type.startswith("image/"):
        raise ImageError(f"data URI media type must be image/*, got {media_type or 'none'!r}", param=PARAM)
    if "base64" not in parts[1:]:
        raise ImageError("image data URI must be base64-encoded (';base64,')", param=PARAM)
    return media_type, payload


def _b64decode(payload: str) -> bytes:
    payload = _strip_whitespace(payload)
    if not payload:
        raise ImageError("data URI contains no image data", param=PARAM)
    payload += "=" * (-len(payload) % 4)  # some encoders drop the padding; it carries no data
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URI is not valid base64: {e}", param=PARAM) from None


def decode_data_uri(uri: str) -> bytes:
    """Decode `data:image/<type>;base64,<data>` to the encoded image bytes.

    Raises ImageError (param='image_url') on a non-image or non-base64 URI, bad base64 or no data.
    """
    _, payload = _split_data_uri(uri)
    return _b64decode(payload)


def _too_many_bytes(n: int, limits: ImageLimits) -> ImageTooLargeError:
    return ImageTooLargeError(
        f"image is {n} bytes, over the limit of {limits.max_bytes} bytes", param=PARAM)


def _read_path(path: str | os.PathLike, limits: ImageLimits) -> bytes:
    """Read a local image file, refusing oversized files before reading them."""
    try:
        size = os.stat(path).st_size
        if size > limits.max_bytes:
            raise _too_many_bytes(size, limits)
        with open(path, "rb") as f:
            # Read at most one byte past the limit: the file may have grown since stat().
            data = f.read(limits.max_bytes + 1)
    except IsADirectoryError:
        raise ImageError(f"image path is a directory: {os.fspath(path)!r}", param=PARAM) from None
    except FileNotFoundError:
        raise ImageError(f"image file not found: {os.fspath(path)!r}", param=PARAM) from None
    except OSError as e:
        raise ImageError(f"cannot read image file {os.fspath(path)!r}: {e.strerror or e}", param=PARAM) from None
    return data


def _source_bytes(source: bytes | bytearray | memoryview | str | os.PathLike, limits: ImageLimits) -> bytes:
    """Encoded bytes of a non-PIL source, with the byte limit enforced as early as possible."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str) and source[:5].lower() == "data:":
        _, payload = _split_data_uri(source)
        # base64 carries 3 bytes per 4 chars: refuse before allocating the decoded copy.
        if len(payload) // 4 * 3 > limits.max_bytes + 3:
            raise _too_many_bytes(len(payload) // 4 * 3, limits)
        data = _b64decode(payload)
    elif isinstance(source, str) and source[:8].lower().startswith(("http://", "https://")):
        raise ImageError("remote image URLs must be fetched by the server first; load_image takes bytes, "
                         "a data: URI, a local path or a PIL image", param=PARAM)
    elif isinstance(source, (str, os.PathLike)):
        data = _read_path(source, limits)
    else:
        raise ImageError(f"unsupported image source type {type(source).__name__}", param=PARAM)
    if not data:
        raise ImageError("image data is empty", param=PARAM)
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(len(data), limits)
    return data


_BOMB_LOCK = threading.Lock()
# Formats whose load() (not only open()) runs Pillow's bomb check on a size the header did not
# bound: TIFF allocates its tile buffer there. GIF's frame-0 checks run inside open().
_LOAD_TIME_BOMB_CHECK = frozenset({"TIFF"})


def _too_large_from_pillow(e: Exception) -> ImageTooLargeError:
    return ImageTooLargeError(f"image rejected by the decompression-bomb guard: {e}", param=PARAM)


@contextlib.contextmanager
def _pillow_bomb_guard() -> Iterator[None]:
    """Turn Pillow's decompression-bomb warning/error into ImageTooLargeError.

    Pillow warns above MAX_IMAGE_PIXELS and raises above twice that. The warning must neither leak
    nor pass silently, so it is raised as an error here. `warnings.catch_warnings` edits
    process-global state, hence the lock; it is held only around header parsing (and TIFF loads),
    so full decodes of ordinary images still run in parallel threads.
    """
    with _BOMB_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            yield
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise _too_large_from_pillow(e) from None


def _check_dimensions(size: tuple[int, int], limits: ImageLimits) -> None:
    """Zero-size -> ImageError; width*height over limits.max_pixels -> ImageTooLargeError."""
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"image has zero size ({width}x{height})", param=PARAM)
    if width * height > limits.max_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels} pixels",
            param=PARAM)


def _allowed_formats(limits: ImageLimits) -> list[str]:
    # Pillow raises on a format name it has no plugin for (e.g. AVIF on an old build): drop those.
    Image.init()
    return [f for f in limits.formats if f.upper() in Image.OPEN]


def _sniff(data: bytes) -> str | None:
    """Format name from the file signature, or None (RIFF/WEBP and ISO-BMFF/AVIF checked by tag)."""
    for magic, name in _SIGNATURES:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp" and data[8:12] in (b"avif", b"avis"):
        return "AVIF"
    return None


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    """Parse only the header (Pillow opens lazily) so limits are checked before pixels are decoded."""
    formats = _allowed_formats(limits)
    try:
        with _pillow_bomb_guard():
            return Image.open(io.BytesIO(data), formats=formats)
    except UnidentifiedImageError:
        kind = _sniff(data)
        if kind is not None:
            raise ImageError(f"corrupt {kind} image: its header cannot be parsed", param=PARAM) from None
        raise ImageError(f"unrecognised or unsupported image format (accepted: {', '.join(formats)})",
                         param=PARAM) from None
    except (ImageError, MemoryError):
        raise
    except Exception as e:  # any parser failure on untrusted bytes is a bad image, not a server error
        raise ImageError(f"cannot read image header (corrupt or truncated): {e}", param=PARAM) from None


def _load_frame0(img: Image.Image) -> None:
    if img.tell() != 0:
        img.seek(0)
    img.load()


def _decode_first_frame(img: Image.Image) -> Image.Image:
    """Seek to frame 0 (animated GIF/WebP/APNG/MPO) and decode it fully."""
    try:
        if img.format in _LOAD_TIME_BOMB_CHECK:
            with _pillow_bomb_guard():
                _load_frame0(img)
        else:
            _load_frame0(img)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_large_from_pillow(e) from None
    except (ImageError, MemoryError):
        raise
    except Exception as e:  # truncated data, bad compression stream, ...
        raise ImageError(f"cannot decode image data (corrupt or truncated): {e}", param=PARAM) from None
    return img


def _apply_exif_orientation(img: Image.Image, *, owned: bool) -> Image.Image:
    """Rotate/flip per the EXIF Orientation tag, like transformers' `load_image` and browsers.

    owned: the image was decoded here, so it may be transposed in place (saves a full copy);
    a caller's PIL image is never mutated.
    """
    try:
        if owned:
            ImageOps.exif_transpose(img, in_place=True)
            return img
        return ImageOps.exif_transpose(img)
    except Exception:
        # Broken EXIF is common in the wild and the pixels are fine: show them unrotated
        # (what browsers do) rather than refusing the image.
        return img


def is_plain_rgb(img: Image.Image) -> bool:
    """Already what to_rgb would return (an RGB image with a tRNS colour key is not)."""
    return img.mode == "RGB" and img.info.get("transparency") is None


def to_rgb(img: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb` for PIL images: transparency composited on white, else convert.

    Transparency = an alpha band (RGBA, LA, PA, ...) or a `transparency` entry (P/L/RGB with tRNS).
    """
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _finish(img: Image.Image, limits: ImageLimits, *, owned: bool) -> Image.Image:
    """Limits -> frame 0 -> EXIF orientation -> RGB (always a new, detached image)."""
    _check_dimensions(img.size, limits)
    img = _decode_first_frame(img)
    img = _apply_exif_orientation(img, owned=owned)
    try:
        rgb = to_rgb(img)
    except (MemoryError, ImageError):
        raise
    except Exception as e:  # modes Pillow cannot convert (e.g. exotic TIFF sample formats)
        raise ImageError(f"cannot convert image of mode {img.mode!r} to RGB: {e}", param=PARAM) from None
    return rgb


def load_image(source: ImageSource, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode and validate one image -> PIL image of mode "RGB", size (W, H) after EXIF rotation.

    source: bytes/bytearray/memoryview (encoded file), PIL.Image.Image, local path (str/PathLike)
    or a `data:image/...;base64,...` string.
    Raises ImageError (empty, corrupt, truncated, unsupported format, zero size) or
    ImageTooLargeError (over limits.max_bytes or limits.max_pixels, or Pillow's bomb guard).
    """
    if isinstance(source, Image.Image):
        return _finish(source, limits, owned=False)
    return _finish(_open(_source_bytes(source, limits), limits), limits, owned=True)


def pixel_hash(img: Image.Image) -> str:
    """sha256 hex of (width, height, RGB bytes): same decoded pixels -> same hash, whatever the file."""
    rgb = img if is_plain_rgb(img) else to_rgb(img)
    h = hashlib.sha256(b"mmjax.rgb8\0")  # domain tag: never collides with a hash of raw file bytes
    h.update(struct.pack("<II", rgb.width, rgb.height))
    h.update(rgb.tobytes())
    return h.hexdigest()
