"""A ``multipart/form-data`` upload parsed as it arrives: the ``file`` part goes to disk in chunks
while its bytes and lines are counted, and the upload stops as soon as a limit is passed. Nothing
holds the whole file in memory (python-multipart's streaming parser, as Starlette uses it, but
without Starlette's unbounded spooling of file parts)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

import anyio
from python_multipart.exceptions import FormParserError, MultipartParseError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from prefixq.openai.apierror import ApiError, bad_request

__all__ = ["Upload", "receive"]

#: form fields other than the file: bytes each, and how many
_MAX_FIELD_BYTES = 4096
_MAX_FIELDS = 16


#: RFC 7578 / 5987: ``filename*=charset'lang'percent-encoded`` (what some clients send for a
#: name that is not ASCII); python-multipart drops it
_EXT_FILENAME = re.compile(rb"""filename\*\s*=\s*([^;'"]*)'[^']*'([^;\s]*)""", re.IGNORECASE)


def _filename(opts: dict[bytes, bytes], disposition: bytes) -> str | None:
    """The part's file name: ``filename*`` first (RFC 7578), then ``filename``; None if neither."""
    m = _EXT_FILENAME.search(disposition)
    if m:
        charset = m.group(1).decode("latin-1") or "utf-8"
        try:
            return unquote_to_bytes(m.group(2)).decode(charset, "replace")
        except LookupError:  # a charset Python does not know
            return unquote_to_bytes(m.group(2)).decode("utf-8", "replace")
    if b"filename" in opts:
        return opts[b"filename"].decode("utf-8", "replace")
    return None


@dataclass(slots=True)
class Upload:
    """What a finished upload holds: the form fields and the file written to ``path``."""

    path: Path
    fields: dict[str, str] = field(default_factory=dict)
    filename: str = ""
    bytes: int = 0
    lines: int = 0
    got_file: bool = False
    last_byte: int = -1


@dataclass(slots=True)
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    is_file: bool = False
    data: bytearray = field(default_factory=bytearray)


class _State:
    """Callbacks of the parser: fields are collected, file data is queued for writing."""

    def __init__(self, up: Upload, max_bytes: int, max_lines: int) -> None:
        self.up, self.max_bytes, self.max_lines = up, max_bytes, max_lines
        self.part = _Part()
        self.field = b""
        self.value = b""
        self.pending: list[bytes] = []
        self.error: ApiError | None = None

    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def on_header_end(self) -> None:
        self.part.headers[self.field.lower()] = self.value
        self.field, self.value = b"", b""

    def on_headers_finished(self) -> None:
        disposition = self.part.headers.get(b"content-disposition", b"")
        _, opts = parse_options_header(disposition)
        self.part.name = opts.get(b"name", b"").decode("latin-1")
        filename = _filename(opts, disposition)
        self.part.is_file = filename is not None and self.part.name == "file"
        if self.part.is_file:
            if self.up.got_file:
                self.error = bad_request("Only one file may be uploaded.", param="file")
            self.up.got_file = True
            self.up.filename = filename or ""

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if not self.part.is_file:
            self.part.data += chunk
            if len(self.part.data) > _MAX_FIELD_BYTES:
                self.error = bad_request(f"The form field {self.part.name!r} is too long.")
            return
        if not chunk:
            return
        up = self.up
        up.bytes += len(chunk)
        up.lines += chunk.count(b"\n")
        up.last_byte = chunk[-1]
        if up.bytes > self.max_bytes:
            self.error = bad_request(
                f"File is too large: over the server's limit of {self.max_bytes} bytes.",
                param="file",
                code="file_too_large",
            )
        elif up.lines > self.max_lines:
            self.error = bad_request(
                f"File has too many lines: over the server's limit of {self.max_lines}.",
                param="file",
                code="too_many_lines",
            )
        self.pending.append(chunk)

    def on_part_end(self) -> None:
        if self.part.is_file or not self.part.name:
            return
        if len(self.up.fields) >= _MAX_FIELDS:
            self.error = bad_request("Too many form fields.")
            return
        self.up.fields[self.part.name] = self.part.data.decode("utf-8", "replace")

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
        }


async def receive(
    chunks: AsyncIterator[bytes],
    content_type: str | None,
    path: Path,
    *,
    max_bytes: int,
    max_lines: int,
) -> Upload:
    """Parse a multipart body from ``chunks``, writing the ``file`` part to ``path``; ApiError
    400 on a malformed body or a passed limit (``path`` is then removed)."""
    ctype, params = parse_options_header(content_type)
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise bad_request("Expected a multipart/form-data body with a boundary.")
    up = Upload(path=path)
    state = _State(up, max_bytes, max_lines)
    try:
        parser = MultipartParser(params[b"boundary"], state.callbacks())  # type: ignore[arg-type]
    except FormParserError as e:  # a boundary over 256 bytes (RFC 2046 allows 70)
        raise bad_request(f"Malformed multipart body: {e}") from None
    try:
        async with await anyio.open_file(path, "wb") as f:
            async for chunk in chunks:
                try:
                    parser.write(chunk)
                except MultipartParseError as e:
                    raise bad_request(f"Malformed multipart body: {e}") from None
                if state.error is not None:
                    raise state.error
                if state.pending:
                    await f.write(b"".join(state.pending))
                    state.pending.clear()
            parser.finalize()
        if state.error is not None:
            raise state.error
        if parser.state != MultipartState.END:  # cut short: the file part may be cut too
            raise bad_request("Malformed multipart body: it ends before its closing boundary.")
        if up.last_byte not in (-1, ord("\n")):
            up.lines += 1  # a last line without its newline
            if up.lines > max_lines:
                raise bad_request(
                    f"File has too many lines: over the server's limit of {max_lines}.",
                    param="file",
                    code="too_many_lines",
                )
    except BaseException:
        await anyio.Path(path).unlink(missing_ok=True)
        raise
    return up
