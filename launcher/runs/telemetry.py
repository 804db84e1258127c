"""Run telemetry: one JSONL row every interval, merging the trainer's own row with a GPU sample.

VRAM comes from the trainer's in-process row (wall 10: a second process cannot see it on
ROCm/Windows); clock, power and utilisation come from the platform's GPU tool. Either part
may be missing: the row keeps what is known, and a missing source is noted once.
"""

import json
import threading
import time

from launcher.progress import warn
from launcher.runs.folders import RunFolder
from launcher.signals.gpu_sources import detect_source
from launcher.user_files import last_rows
from launcher.writer import open_append


def trainer_figures(rows: list[dict]) -> dict | None:
    """The newest trainer row's figures, with `s_it` from the newest row that has a speed.

    Rows the trainer writes for an event (start, save, while loading) carry the step and memory
    but no speed; a load phase's own figures stay in the trainer's file (run.json gets them).
    """
    if not rows:
        return None
    event_only = ("time", "event", "s_per_it", "phase", "since_start_s", "memory_plan")
    figures = {key: value for key, value in rows[0].items() if key not in event_only}
    figures["trainer_time"] = rows[0].get("time")
    figures["s_it"] = next((row["s_per_it"] for row in rows if row.get("s_per_it") is not None), None)
    return figures


class TelemetryRecorder:
    """Context manager: a daemon thread writing `run.telemetry` until the block exits."""

    def __init__(self, run: RunFolder, settings: dict, source=None, clock=time.time) -> None:
        self.run = run
        self.interval = float(settings.get("interval_s", 10))
        self.enabled = bool(settings.get("enabled", True))
        self._noted: set[str] = set()
        self.source = source if source is not None else detect_source(note=self._note_once)
        self.clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)

    def __enter__(self) -> "TelemetryRecorder":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5)
        if self.enabled:
            self.record()  # the final state, so a short run still has a row

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.record()

    def record(self) -> dict:
        row = {"t": round(self.clock(), 3)}
        trainer = trainer_figures(last_rows(self.run.trainer_telemetry))
        if trainer is None:
            self._note_once(f"no in-trainer telemetry yet in {self.run.trainer_telemetry}")
        else:
            row.update(trainer)
        sample = self.source.sample() if self.source is not None else None
        if sample is not None:
            row.update({key: value for key, value in sample.to_row().items() if key != "t"})
        with open_append(self.run.root, self.run.telemetry, text=True) as handle:
            handle.write(json.dumps(row) + "\n")
        return row

    def _note_once(self, message: str) -> None:
        if message not in self._noted:
            self._noted.add(message)
            warn(message)
