"""Progress lines for long work, flushed at once so a redirected log keeps them."""

import sys
import time
from contextlib import contextmanager, nullcontext, redirect_stdout


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
