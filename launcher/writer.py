"""The one writer: every file the launcher writes is written here.

Four promises, whatever the file:

- no link is followed: each folder between the root the caller names and the file is checked
  with lstat (links and Windows junctions refused), and every file is opened with O_NOFOLLOW
  where the platform has it, or created with O_EXCL, which never follows a link anywhere;
- the bytes go to a temporary name in the same folder, flushed to disk, then renamed into place
  (atomic on Windows and POSIX): a reader sees the old file or the new one, never half;
- on any error (a full disk, a permission, a kill of the command's own making) the partial file is
  removed and the error is one line naming the file;
- a file the launcher did not write is never replaced: `write_new`/`new_file` reserve the name
  with O_EXCL before writing, so whatever stands there (a user's file, a link) makes it refuse,
  and `replace_own`/`own_file` are for the launcher's own state in its own folders (the workdir,
  a run folder), where a file of that name is one it wrote.

Logs and telemetry grow by appending (`open_append`); flag files are created empty (`touch`).
"""

import errno
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path

from launcher.errors import LauncherError, os_error_line
from launcher.nofollow import is_link, link_error, refuse_links

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # POSIX: a FIFO there answers at once instead of waiting for a reader
BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def _open(root: Path, path: Path, flags: int) -> int:
    """A descriptor of a regular file at `path`, never a link, a FIFO or a device there."""
    refuse_links(root, path)
    try:
        descriptor = os.open(path, flags | NOFOLLOW | NONBLOCK | BINARY, 0o666)
    except OSError as error:
        if is_link(path):  # ELOOP from O_NOFOLLOW, EEXIST from O_EXCL
            raise link_error(path) from None
        if error.errno == errno.EEXIST:
            raise LauncherError(f"{path} exists; it is never overwritten: give another name, or move it away") from None
        if error.errno == errno.ENXIO:  # a FIFO with no reader
            raise not_a_file(path) from None
        raise LauncherError(f"cannot write {os_error_line(_named(error, path))}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise not_a_file(path)
    return descriptor


def not_a_file(path: Path) -> LauncherError:
    return LauncherError(f"{path} is not a regular file (a FIFO or a device); the launcher writes only files: "
                         "remove it, and run the command again")


def _named(error: OSError, path: Path) -> OSError:
    return error if error.filename else OSError(error.errno, error.strerror, str(path))


def _fdopen(descriptor: int, text: bool):
    return os.fdopen(descriptor, "w", encoding="utf-8", newline="\n") if text else os.fdopen(descriptor, "wb")


@contextmanager
def staged(path: Path, root: Path | None = None, replace: bool = False):
    """A fresh, empty temporary file beside `path`, for the caller (or a child process) to fill;
    renamed to `path` when the block ends, removed on any error. Without `replace`, `path` is
    reserved first (O_EXCL): whatever stands there, a file or a link, makes it refuse at once."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    refuse_links(root, path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LauncherError(f"cannot write {os_error_line(_named(error, path.parent))}") from None
    if path.is_dir() and not is_link(path):
        raise LauncherError(f"{path} is a folder; a file of that name cannot be written: give another name")
    reserved = None
    if not replace:
        os.close(_open(root, path, CREATE))  # the name is ours now
        reserved = path
    # the target's suffix last: a child that picks a format by it (matplotlib's savefig) writes the right one
    temporary = path.with_name(f".{path.stem[:120]}.{os.getpid()}-{secrets.token_hex(3)}.partial{path.suffix[:20]}")
    try:
        os.close(_open(root, temporary, CREATE))
        yield temporary
        os.replace(temporary, path)  # over our own reservation, or over a file (or a link) of our own
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if reserved is not None:
            reserved.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise LauncherError(f"cannot write {os_error_line(_named(error, path))}") from None
        raise


@contextmanager
def _handle(path: Path, root: Path | None, replace: bool, text: bool):
    with staged(path, root, replace) as temporary:  # its folder checked there; the name is fresh
        with _fdopen(_open(temporary.parent, temporary, os.O_WRONLY | os.O_TRUNC), text) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())


def new_file(path: Path, root: Path | None = None, text: bool = False):
    """A handle to write a file that must not exist yet (an `--out`, a report, a copy into another
    program's folder); it appears whole when the block ends, or not at all."""
    return _handle(path, root, replace=False, text=text)


def own_file(path: Path, root: Path | None = None, text: bool = False):
    """A handle to write one of the launcher's own files in its own folders, replacing the old one whole."""
    return _handle(path, root, replace=True, text=text)


def _write(handle_of, path: Path, data: str | bytes, root: Path | None) -> Path:
    with handle_of(path, root, text=isinstance(data, str)) as handle:
        handle.write(data)
    return Path(path)


def write_new(path: Path, data: str | bytes, root: Path | None = None) -> Path:
    return _write(new_file, path, data, root)


def replace_own(path: Path, data: str | bytes, root: Path | None = None) -> Path:
    return _write(own_file, path, data, root)


def differing(targets: dict[Path, str]) -> list[Path]:
    """The files of `targets` (path: the text a generator gives it) that are missing or hold other
    text: what a generator's `--check` names and what it writes again."""
    return [path for path, text in targets.items() if not path.is_file() or path.read_text(encoding="utf-8") != text]


def publish_folder(staging: Path, final: Path) -> Path:
    """A folder built whole under a staging name takes its real name; one standing there (a folder
    of the user's, a link) is never replaced."""
    if final.exists() or is_link(final):
        raise LauncherError(f"{final} exists; it is never replaced: move it away, or name another folder")
    try:
        staging.rename(final)
    except OSError as error:
        raise LauncherError(f"cannot rename {staging} to {os_error_line(_named(error, final))}") from None
    return final


def link_new(path: Path, to: Path) -> Path:
    """A link the user asked for (`comfy --link`) at a name where nothing stands; an OSError (Windows
    without Developer Mode, a FAT drive) is the caller's to answer, with a copy."""
    if path.exists() or is_link(path):
        raise LauncherError(f"{path} exists; it is never overwritten: give another name, or move it away")
    path.symlink_to(to)
    return path


def open_append(root: Path, path: Path, text: bool = False):
    """`path` (inside `root`) opened for appending, created when missing."""
    descriptor = _open(root, path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(descriptor, "a", encoding="utf-8") if text else os.fdopen(descriptor, "ab")


def touch(root: Path, path: Path) -> Path:
    """Create `path` (inside `root`) when missing, without following a link."""
    os.close(_open(root, path, os.O_WRONLY | os.O_CREAT))
    return path
