"""The one reader for every file the launcher reads on a user's behalf.

Presets and their parents, run configs, run.json, captions, images, logs, telemetry and the JSON
files of a model folder all come from folders a user (or whoever shared a dataset or a run folder) controls. Read naively, a
caption linked to /dev/zero fills the memory, a FIFO named like an image blocks forever, a
folder named `x.txt` ends in a traceback, and a caption saved as UTF-16 without a byte-order
mark decodes "fine" as UTF-8 into text full of NUL characters. Here every read:

- opens regular files only (a device, FIFO, socket or folder is refused before a byte is read;
  the open does not block on a FIFO, and the kind is checked again on the open handle);
- reads at most the cap of its kind (KINDS), or only the tail of a log;
- with `within`, follows no link at or below that folder (the field report);
- decodes text one way: UTF-8 (a UTF-8 byte-order mark is fine), with UTF-16/32 (with or without
  a byte-order mark) and NUL bytes refused;
- fails with one UserFileError line that names the file and says what to do.
"""

import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from launcher.errors import LauncherError
from launcher.nofollow import first_link

MIB = 2**20
KINDS = {
    # kind: (the most bytes read, what such a file is, in words)
    "preset": (1 * MIB, "a preset or run config is a few kB"),
    "metadata": (1 * MIB, "a run's run.json is a few kB"),
    "caption": (1 * MIB, "a caption is a few hundred bytes"),
    "notes": (1 * MIB, "a notes or version file is a few kB"),
    "model_json": (16 * MIB, "a model's config.json or safetensors index, or a text encoder record, is at most a few MB"),
    "image": (1024 * MIB, "the trainer opens no image larger than PIL's 179 Mpx limit"),
    "log": (256 * 1024, "only the end of a log is read"),
    "telemetry": (64 * 1024, "only the newest rows of a telemetry file are read"),
    "history": (4 * MIB, "a run's plots read the newest rows of its telemetry, about a day of them"),
}
"""`log`, `telemetry` and `history` are tails: a larger file is read from its end, never refused."""
BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))
TAILS = ("log", "telemetry", "history")
NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # POSIX: opening a FIFO returns at once
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
BINARY = getattr(os, "O_BINARY", 0)


class UserFileError(LauncherError):
    """A file the launcher will not read; `reason` is the message without the path in front."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path = path
        self.reason = reason


def _kind_of(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    for test, words in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                        (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return None if stat.S_ISREG(mode) else "not a regular file"


def _refuse_special(path: Path, mode: int) -> None:
    found = _kind_of(mode)
    if found:
        raise UserFileError(path, f"is {found}, not a regular file; the launcher reads only plain files here: "
                                  "put the file itself in its place")


def _refuse_links(within: Path, path: Path) -> None:
    link = first_link(within, path)
    if link is not None:
        raise UserFileError(link, "is a link; the launcher follows no link here (it could lead to "
                                  "another user's files): replace it by the file or folder itself")


def open_regular(path: Path, within: Path | None = None) -> BinaryIO:
    """A regular file opened for reading, for a reader that takes only the bytes it needs (a
    safetensors header); a FIFO, device or folder is refused before it could block or flood it."""
    path = Path(path)
    try:
        if within is not None:
            _refuse_links(within, path)
        _refuse_special(path, (os.lstat(path) if within is not None else os.stat(path)).st_mode)
        descriptor = os.open(path, os.O_RDONLY | NONBLOCK | BINARY | (NOFOLLOW if within is not None else 0))
    except OSError as error:
        raise UserFileError(path, f"cannot be read ({error.strerror or error})") from None
    handle = os.fdopen(descriptor, "rb")
    try:
        _refuse_special(path, os.fstat(descriptor).st_mode)
    except UserFileError:
        handle.close()
        raise
    return handle


def _read(path: Path, kind: str, within: Path | None) -> tuple[bytes, bool]:
    """(the bytes read, whether the file was longer than the cap of its tail kind)."""
    cap, words = KINDS[kind]
    path = Path(path)
    with open_regular(path, within) as handle:
        info = os.fstat(handle.fileno())
        if info.st_size <= cap:
            data = handle.read(info.st_size + 1)  # a buffer of the file's size, not of the cap
            if len(data) > info.st_size:  # it grew since: read on up to the cap
                data += handle.read(cap + 1 - len(data))
            if len(data) <= cap:
                return data, False
        if kind not in TAILS:
            raise UserFileError(path, f"is {max(info.st_size, cap + 1):,} bytes; {words} (at most {cap:,} bytes "
                                      "are read): is it the right file?")
        handle.seek(max(0, info.st_size - cap))
        return handle.read(cap), True


def read_bytes(path: Path, kind: str, within: Path | None = None) -> bytes:
    """The bytes of a regular file, at most the cap of `kind` (a tail kind: its last bytes);
    with `within`, no link at or below that folder is followed."""
    return _read(path, kind, within)[0]


def decode(path: Path, data: bytes) -> str:
    """UTF-8 text; UTF-16/32 and NUL bytes are refused with the file named."""
    for mark, encoding in BOMS:
        if data.startswith(mark):
            raise UserFileError(path, f"is {encoding} text (it starts with a byte-order mark); save it as UTF-8")
    if b"\x00" in data:
        where = data.index(b"\x00")
        likely = " (it looks like UTF-16 without a byte-order mark)" if data[1::2].count(0) > len(data) // 4 else ""
        raise UserFileError(path, f"holds a NUL byte at byte {where}{likely}; save it as UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserFileError(path, f"is not UTF-8 text (byte {error.start}); save it as UTF-8") from None


def read_text(path: Path, kind: str, within: Path | None = None) -> str:
    """`read_bytes` decoded by `decode`; a tail starts at its first whole line."""
    data = read_bytes(path, kind, within)
    if kind in TAILS:
        return data.decode("utf-8", errors="replace")
    return decode(path, data)


def load_json(path: Path, kind: str, within: Path | None = None):
    """The JSON value of a file read by `read_text`; one that is not JSON, or nests deeper than
    Python's parser recurses (a planted `[[[[...`), is a UserFileError naming it."""
    text = read_text(path, kind, within)
    try:
        return json.loads(text)
    except RecursionError:
        raise UserFileError(path, "nests too deeply to be the launcher's JSON (thousands of levels): "
                                  "is it the right file?") from None
    except ValueError as error:
        raise UserFileError(path, f"is not valid JSON ({error}): is it the right file?") from None


def load_json_state(path: Path, kind: str = "metadata") -> dict:
    """A state file the launcher wrote and can do without: {} when it is missing, damaged, not an
    object, or not a regular file (the command then goes on as if it had none)."""
    try:
        state = load_json(path, kind)
    except UserFileError:
        return {}
    return state if isinstance(state, dict) else {}


def json_row(line: str | bytes):
    """One line of a JSONL file, or None where it is not JSON (a line still being written, one cut
    by a tail, or one nested too deeply to parse)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def read_tail_lines(path: Path, lines: int, within: Path | None = None) -> str:
    """The last `lines` lines of a log, from at most its last KINDS['log'] bytes (a line cut by the
    cap is dropped); undecodable bytes are replaced, as a log may end mid-character."""
    data, cut = _read(path, "log", within)
    if cut and b"\n" in data:
        data = data[data.index(b"\n") + 1:]
    text = data.decode("utf-8", errors="replace")
    return "".join(text.splitlines(keepends=True)[-lines:])


def last_rows(path: Path, within: Path | None = None) -> list[dict]:
    """The complete JSON rows at the end of a file another process appends to, newest first; none
    where it is missing or not a regular file (a FIFO planted there is never opened for reading), or
    with `within`, where a link lies at or below that folder."""
    try:
        lines = read_bytes(path, "telemetry", within).splitlines()
    except UserFileError:
        return []
    rows = []
    for line in reversed(lines):
        row = json_row(line)
        if isinstance(row, dict):
            rows.append(row)
    return rows
