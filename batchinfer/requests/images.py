"""A row's image (prompt.image_column): where it is (a path relative to the input file, a `file://`
or `data:` URL, bytes, or an http URL only where prompt.image_http allows), its bytes read within
prompt.image_max_bytes, its content digest, and its pixels decoded with Pillow within
prompt.image_max_pixels. A missing, unreadable, empty, corrupt or oversized image is that row's
RowError kind `image`, naming the file. The chat gets the image as a part before the row's text
(vLLM's `image` part: the chat template places the model's image token).

Nothing here imports vllm or torch: validate runs it on a login node; the worker decodes in its
ahead thread (engine/ahead.py), a window of rows at a time."""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import io
import os
import stat
import urllib.parse
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.schema import PromptConfig
from batchinfer.inputs.openai_batch import IMAGE_URL
from batchinfer.requests.image_budget import RGB_BYTES, ImageBudget, NoRoom
from batchinfer.requests.prompts import Messages, Prompt, RowError

KIND = "image"
IMAGE_PART = {"type": "image"}  # what the chat template sees; the pixels travel beside the prompt
HTTP_TIMEOUT_S = 30


class Source(enum.Enum):
    """How a row names its image."""

    PATH = "path"
    FILE_URL = "file URL"
    DATA_URL = "data URL"
    HTTP_URL = "http URL"
    BYTES = "bytes"


@dataclass(frozen=True)
class ImageLimits:
    """What a run allows of an image: its bytes, its pixels, fetching http URLs, and where relative
    paths start (the input file's folder)."""

    base_dir: Path
    max_bytes: int
    max_pixels: int
    allow_http: bool = False

    @classmethod
    def of(cls, prompt: PromptConfig, input_path: Optional[str]) -> ImageLimits:
        """The limits of a run's config (relative paths start at input.path's folder)."""
        base = Path(input_path).expanduser().parent if input_path else Path.cwd()
        return cls(base, prompt.image_max_bytes, prompt.image_max_pixels, prompt.image_http)


@dataclass(frozen=True)
class ImageRef:
    """Where a row's image is: a file (path), a URL, or bytes held in the row."""

    source: Source
    where: str  # what error messages name: the file's path, the URL, or "N bytes in the row"
    path: Optional[Path] = None
    data: Optional[bytes] = None


@dataclass
class RowImage:
    """A row's image: the digest of its bytes (its identity for dedup and output.reuse), its size,
    and its decoded RGB pixels (a PIL image; None where only the header was checked)."""

    digest: str
    where: str
    width: int
    height: int
    pixels: Any = field(default=None, repr=False, compare=False)


def image_ref(value: Any, column: str, limits: ImageLimits) -> ImageRef:
    """Where the column's value says the image is; RowError kind image when it names none."""
    if isinstance(value, dict):  # the `datasets` Image feature, Parquet {bytes, path}
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise RowError(KIND, f"field {column!r} is an object without bytes or path; give a path, URL or bytes")
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return ImageRef(Source.BYTES, f"{len(data)} bytes in field {column!r}", data=data)
    if not isinstance(value, str) or not value.strip():
        what = "null" if value is None else f"{type(value).__name__} {value!r:.60}"
        raise RowError(KIND, f"field {column!r} is {what}, not an image path, URL or bytes")
    text = value.strip()
    scheme = text.split(":", 1)[0].lower() if ":" in text[:12] else ""
    if scheme == "data":
        return ImageRef(Source.DATA_URL, f"a data URL ({len(text)} characters)", data=_data_url(text))
    if scheme == "file":
        parsed = urllib.parse.urlparse(text)
        path = Path(urllib.parse.unquote(parsed.path))
        return ImageRef(Source.FILE_URL, str(path), path=path)
    if scheme in ("http", "https"):
        if not limits.allow_http:
            raise RowError(
                KIND, f"{text:.200} is an http URL: not fetched unless the config allows it (prompt.image_http=true)"
            )
        return ImageRef(Source.HTTP_URL, text)
    path = Path(text).expanduser()
    path = path if path.is_absolute() else limits.base_dir / path
    return ImageRef(Source.PATH, str(path), path=path)


def _data_url(text: str) -> bytes:
    head, _, payload = text.partition(",")
    if not head.lower().startswith("data:image/") or ";base64" not in head.lower():
        raise RowError(KIND, f"a data URL ({head[:60]!r}) is not a base64 image (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RowError(KIND, f"a data URL's base64 payload does not decode: {e}") from None


def read_image_bytes(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The image's bytes, at most limits.max_bytes; RowError kind image naming the file otherwise."""
    if ref.data is not None:
        data = ref.data
    elif ref.path is not None:
        data = _read_file(ref.path, limits.max_bytes)
    else:
        data = _fetch(ref.where, limits.max_bytes)
    if not data:
        raise RowError(KIND, f"image {ref.where} is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise RowError(
            KIND, f"image {ref.where} has {len(data):,} bytes, over prompt.image_max_bytes={limits.max_bytes:,}"
        )
    return data


def open_regular(path: Path) -> int:
    """A descriptor of the file opened for reading without blocking (a FIFO would wait for a writer for
    ever); NotRegular when it is not a regular file (a FIFO, a device such as /dev/zero, a socket)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(_kind_of(mode))
    os.set_blocking(fd, True)
    return fd


class NotRegular(OSError):
    """The path names no regular file: what it is instead (a FIFO, a character device, ...)."""


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _read_file(path: Path, max_bytes: int) -> bytes:
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:  # not read at all: the message says how big it is
                raise RowError(
                    KIND,
                    f"image {path} has {size:,} bytes, over prompt.image_max_bytes={max_bytes:,}; shrink it or raise the limit",
                )
            return f.read(max_bytes + 1)
    except FileNotFoundError:
        raise RowError(KIND, f"image {path}: no such file (relative paths start at the input file's folder)") from None
    except IsADirectoryError:
        raise RowError(KIND, f"image {path} is a folder, not an image file") from None
    except NotRegular as e:
        raise RowError(KIND, f"image {path} is {e}, not an image file; name a regular file") from None
    except OSError as e:
        raise RowError(KIND, f"image {path} cannot be read: {e.strerror or e}") from None


def _fetch(url: str, max_bytes: int) -> bytes:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:  # noqa: S310 (http(s) only: image_ref)
            return r.read(max_bytes + 1)
    except Exception as e:  # any network failure is this row's
        raise RowError(KIND, f"image {url:.200} could not be fetched: {type(e).__name__}: {e}") from None


def image_digest(data: bytes) -> str:
    """The content digest of an image's bytes: the same picture under two paths is one request."""
    return image_hasher(data).hexdigest()


def image_hasher(data: bytes = b"") -> Any:
    """image_digest's hash, to be fed a file's bytes a chunk at a time (.update, .hexdigest)."""
    return hashlib.blake2b(data, digest_size=16)


def open_image(
    data: bytes, where: str, limits: ImageLimits, decode: bool = True, budget: Optional[ImageBudget] = None
) -> RowImage:
    """The image's size from its header and, when decode, its pixels as RGB; RowError kind image
    when Pillow cannot read it or it has more than limits.max_pixels pixels; NoRoom when its pixels
    do not fit the budget beside those held (decoded, they are held under it)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            width, height = img.size
            if width * height > limits.max_pixels:
                raise RowError(
                    KIND,
                    f"image {where} is {width}x{height} pixels, over prompt.image_max_pixels={limits.max_pixels:,}; "
                    "shrink it or raise the limit",
                )
            nbytes = width * height * RGB_BYTES
            if decode and budget is not None and not budget.admits(nbytes):
                raise NoRoom(nbytes)
            pixels = img.convert("RGB") if decode else None  # convert loads (decodes) every pixel
            if pixels is not None and budget is not None:
                budget.hold(pixels, nbytes)
    except (RowError, NoRoom):
        raise
    except Image.UnidentifiedImageError:  # its text names a BytesIO's address: no two runs would agree
        raise RowError(KIND, f"image {where} does not decode as an image: not a format Pillow reads") from None
    except Exception as e:  # a truncated file's OSError, a decompression bomb
        raise RowError(KIND, f"image {where} does not decode as an image: {type(e).__name__}: {e}") from None
    return RowImage(image_digest(data), where, width, height, pixels)


def absolute_image_paths(values: list[Any], base_dir: Path) -> list[Any]:
    """Column values with each relative image path made absolute against base_dir (a `datasets`
    {bytes, path} without bytes too): a redo pass's selection of rows lives in another folder than
    the input its paths were relative to. URLs, bytes and absolute paths stay as they are."""

    def fixed(value: Any) -> Any:
        if isinstance(value, dict) and value.get("bytes") is None and isinstance(value.get("path"), str):
            return dict(value, path=fixed(value["path"]))
        if not isinstance(value, str) or not value.strip():
            return value
        text = value.strip()
        if ":" in text[:12] and text.split(":", 1)[0].lower() in ("data", "file", "http", "https"):
            return value
        path = Path(text).expanduser()
        return value if path.is_absolute() else str(base_dir / path)

    return [fixed(v) for v in values]


def image_column(prompt: PromptConfig, row: dict[str, Any]) -> Optional[str]:
    """The column holding a row's image: prompt.image_column, else an OpenAI request's image_url part."""
    if prompt.image_column:
        return prompt.image_column
    return IMAGE_URL if row.get(IMAGE_URL) is not None else None


def row_image(
    row: dict[str, Any], column: str, limits: ImageLimits, decode: bool = True, budget: Optional[ImageBudget] = None
) -> RowImage:
    """A row's image from its column: located, read, digested and (decode) decoded, its pixels
    held under budget (NoRoom: they do not fit now)."""
    ref = image_ref(row.get(column), column, limits)
    return open_image(read_image_bytes(ref, limits), ref.where, limits, decode, budget)


def with_image(prompt: Prompt) -> Messages:
    """The chat with the image part first in its last user turn, the turn's text after it."""
    if isinstance(prompt, str):
        raise RowError(KIND, "an image needs a chat prompt (prompt.mode=chat), not a raw prompt")
    users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
    if not users:
        raise RowError(KIND, "the chat has no user turn to hold the image")
    turn = users[-1]
    text = prompt[turn]["content"]
    content = [dict(IMAGE_PART), {"type": "text", "text": text}]
    return [*prompt[:turn], dict(prompt[turn], content=content), *prompt[turn + 1 :]]  # type: ignore[dict-item]
