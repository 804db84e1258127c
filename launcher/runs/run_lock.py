"""One trainer per run folder: `run` holds an OS-level lock on the folder while its trainer lives.

Two runs on one folder would both start from the same step and overwrite each other's LoRA
and optimizer state. The lock is the operating system's (fcntl.flock on Linux and macOS,
msvcrt.locking on Windows), so it dies with the launcher process however that ends: kill -9,
a crash or a power cut leave no stale lock behind. Beside it a small info file says who holds
it (pid, host, start time, command), for the message the second `run` prints.
"""

import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from launcher.errors import LauncherError
from launcher.user_files import load_json_state
from launcher.writer import open_append, replace_own

LOCK_FILE = "run.lock"
INFO_FILE = "run.lock.json"


def _try_lock(handle) -> bool:
    """Take the lock without waiting; False when another process holds it."""
    try:
        if os.name == "nt":
            import msvcrt

            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def holder(root: Path) -> str:
    """Who holds the lock, in words, from the info file it wrote."""
    info = load_json_state(root / INFO_FILE)  # a FIFO or a planted giant there is no holder's note
    try:
        return (f"pid {info['pid']} on {info['host']}, started {info['started']} "
                f"({' '.join(info['command'])})")
    except (KeyError, TypeError):
        return "another process (it has not written who it is yet)"


def is_held(root: Path) -> bool:
    """Whether a trainer holds the folder's lock now (taking it for a moment to find out)."""
    if not (root / LOCK_FILE).is_file():
        return False
    with open_append(root, root / LOCK_FILE) as handle:  # never through a link planted there
        if not _try_lock(handle):
            return True
        if os.name == "nt":
            import msvcrt

            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
    return False  # closing released it elsewhere


@contextmanager
def run_folder_lock(root: Path):
    """Hold the run folder's lock for the body; refuse at once when another run holds it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LauncherError(f"cannot create the run folder {root} ({error.strerror or error}); give --output "
                            "a folder you can write to") from None
    handle = open_append(root, root / LOCK_FILE)
    if not _try_lock(handle):
        handle.close()
        raise LauncherError(
            f"{root} is in use by another run: {holder(root)}. Wait for it to finish, stop it with "
            f"`python -m launcher stop {root}`, or give this run another --output."
        )
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": sys.argv}
    replace_own(root / INFO_FILE, json.dumps(info) + "\n")
    try:
        yield
    finally:
        (root / INFO_FILE).unlink(missing_ok=True)
        handle.close()  # closing releases the lock on every platform
