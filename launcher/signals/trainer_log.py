"""The trainer's progress, read from its output: steps, seconds per step, loss and saves.

ai-toolkit draws a tqdm bar (toolkit/progress_bar.py) whose updates are written with carriage
returns, e.g. `name:  12%|#2  | 243/2000 [40:31<4:52:56,  9.99s/it, lr: 1.0e-04 loss: 3.456e-01]`,
and prints `Saving at step N` before each checkpoint. The bar's own rate is an exponential
average that reacts slowly to a stall, so `StepTracker` measures seconds per step from the
bar's elapsed field between consecutive steps (the bar excludes paused time, i.e. saves), and
falls back to the printed rate when it has no previous step to compare with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_BAR = re.compile(
    r"(?P<n>\d+)/(?P<total>\d+) \[(?P<elapsed>[\d:]+)<[^,\]]*, *"
    r"(?P<rate>[\d.]+|\?)(?P<unit>s/it|it/s)(?:, *(?P<postfix>[^\]]*))?\]"
)
_LOSS = re.compile(r"\bloss: *(-?[\d.]+(?:e[-+]?\d+)?|nan|inf)", re.IGNORECASE)
_SAVING = re.compile(r"Saving at step (\d+)")


@dataclass(frozen=True)
class Progress:
    """The trainer finished `step` at time `t`, taking `s_it` seconds for the last step(s)."""

    t: float
    step: int
    s_it: float | None
    loss: float | None = None


@dataclass(frozen=True)
class Saved:
    """The trainer started writing a checkpoint at `step`."""

    t: float
    step: int


def parse_elapsed(text: str) -> float:
    """tqdm's elapsed field: "MM:SS" or "H:MM:SS" (hours may exceed 24)."""
    seconds = 0.0
    for part in text.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


class StepTracker:
    """Feed it output lines (with the time they were read); it returns Progress and Saved."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.last: Progress | None = None
        """The newest Progress (telemetry rows copy step, s/it and loss from it)."""
        self._elapsed: float | None = None

    def feed(self, line: str, t: float) -> list[Progress | Saved]:
        out: list[Progress | Saved] = []
        for segment in re.split(r"[\r\n]", line):
            saving = _SAVING.search(segment)
            if saving:
                out.append(Saved(t=t, step=int(saving.group(1))))
            bars = list(_BAR.finditer(segment))
            if bars:
                progress = self._bar(bars[-1], t)
                if progress is not None:
                    out.append(progress)
        return out

    def _bar(self, bar: re.Match, t: float) -> Progress | None:
        n = int(bar["n"])
        elapsed = parse_elapsed(bar["elapsed"])
        previous_step, previous_elapsed = self.step, self._elapsed
        if n == previous_step:
            return None  # the same step redrawn (postfix update, pause)
        self.step, self._elapsed = n, elapsed
        if n == 0:
            return None  # the bar was just drawn; no step finished yet
        if previous_step is not None and n > previous_step and elapsed > previous_elapsed:
            s_it = (elapsed - previous_elapsed) / (n - previous_step)
        else:  # first step seen, a new bar (resume), or sub-second steps
            s_it = _rate_to_s_it(bar["rate"], bar["unit"])
        loss = _LOSS.search(bar["postfix"] or "")
        self.last = Progress(t=t, step=n, s_it=s_it, loss=float(loss.group(1)) if loss else None)
        return self.last


def _rate_to_s_it(rate: str, unit: str) -> float | None:
    if rate == "?":
        return None
    value = float(rate)
    if unit == "s/it":
        return value
    return 1.0 / value if value > 0 else None


class LogFollower:
    """Reads what has been appended to a log since the last call, in whole \\r/\\n segments.

    The log is opened per read (Windows lets the writer keep it open), bytes are decoded as
    UTF-8 with replacement, and a half-written last segment waits for the next call.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[str]:
        try:
            with self.path.open("rb") as log:
                size = log.seek(0, 2)
                if size < self._offset:  # truncated: a new run reuses the file
                    self._offset, self._partial = 0, b""
                log.seek(self._offset)
                data = log.read()
        except OSError:
            return []
        self._offset += len(data)
        data = self._partial + data
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            self._partial = data
            return []
        self._partial = data[cut + 1:]
        return [part.decode("utf-8", "replace") for part in re.split(rb"[\r\n]+", data[: cut + 1]) if part]
