"""Whole-or-nothing file writes for the launcher's state files.

A kill between `open('w')` and the last byte leaves a half-written JSON file that the next
command misreads. Writing to a temporary name in the same folder, flushing it to disk and
renaming it over the target (os.replace is atomic on Windows and POSIX) means a reader sees
either the old file or the new one. The rename replaces a link at the target, never its target.
"""

import os
from pathlib import Path

from launcher.nofollow import create_new


def write_text_atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with create_new(path.parent, temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
