"""Progress lines for long work, flushed at once so a redirected log keeps them."""

import sys
import time
from contextlib import contextmanager, nullcontext, redirect_stdout


def utf8_output() -> None:
    """The launcher's own output in UTF-8, whatever it goes to: on Windows a pipe or a file (a log, a
    GUI wrapper, CI) gets the ANSI code page, where a workdir or a user name in Cyrillic or Chinese
    raises UnicodeEncodeError at the first line that shows it. An undecodable file name's stray
    surrogate is written as an escape, never raised."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors="backslashreplace")


def say(message: str) -> None:
    print(message, flush=True)


def quiet_stdout(active: bool = True):
    """While active, everything printed goes to stderr, so stdout carries only a command's JSON."""
    return redirect_stdout(sys.stderr) if active else nullcontext()


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


@contextmanager
def step(label: str):
    """Print `label ...` before the work and the elapsed seconds after it."""
    say(f"{label} ...")
    started = time.monotonic()
    yield
    say(f"{label}: done in {time.monotonic() - started:.1f} s")
