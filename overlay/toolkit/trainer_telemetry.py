"""In-trainer telemetry: one JSON line at most every model_kwargs telemetry_interval_s seconds (default
10) appended to the file model_kwargs telemetry_file names (`run` writes both), plus a row at the start of training and after
each checkpoint save (a stall watchdog uses saves as a trigger).

Loading is reported too: a row at the end of each load phase (text encoder, transformer from
the file or the quantized cache) with its duration, a row every interval while the model
loads (host RSS over time), and a row at the first trained step with the time since the
process started. Peak host RSS (VmHWM / PeakWorkingSetSize, toolkit/host_memory.py) is in
every row: it is what decides whether a run needs a pagefile.

VRAM is read here, in the training process: on ROCm/Windows a second process reading
torch.cuda.mem_get_info() sees ~0 GB in use while the trainer holds 20 GB. Each row is
appended and flushed on its own, so a crash loses at most the row being written. Without
telemetry_file nothing is opened and each call returns at once.

    {"time": unix seconds, "step": steps done, "loss": float, "s_per_it": mean since last row,
     "vram_allocated_gib", "vram_reserved_gib", "vram_max_allocated_gib": null without a GPU,
     "vram_alloc_retries": times the allocator found the cap full, freed its cache and tried again
       (each a device-wide synchronization: a step planned too close to the cap pays them),
     "host_pinned_gib": pinned host memory the caching host allocator holds (staging, streamed blocks),
     "host_rss_gib", "host_peak_rss_gib",
     "event": "start" | "save" | "load" | "phase" | "first_step" | "sample_start" | "sample" (event rows only),
     "phase": {"name", "seconds", what the phase reports} (phase rows),
     "since_start_s": seconds since the process started (first_step row),
     "seconds", "images": how long in-training sampling took and how many images (sample row)}
"""

import json
import math
import os
import sys
import threading
import time

from toolkit.host_memory import peak_rss_bytes
from flux2_contract.files import rank_file
from flux2_contract.settings import read

GIB = 2 ** 30
LOAD_SAMPLE_AT_INTERVAL_ZERO_S = 1.0
"""telemetry_interval_s: 0 means a row per step; while loading there are no steps: once a second."""


class TrainerTelemetry:
    def __init__(self, path: str, interval: float):
        self.path = path
        self.interval = interval
        self.step = None
        self.loss = None
        self.row_time = time.time()
        self.row_step = None
        self.process = None
        self.started = self.row_time
        self._lock = threading.Lock()
        self._loading = None  # the sampler thread's stop event while the model loads
        self._first_step_seen = False
        try:
            import psutil
            self.process = psutil.Process()
            self.started = self.process.create_time()
        except Exception:
            pass

    def on_step(self, step: int, losses: dict) -> None:
        if not self._first_step_seen:
            self._first_step_seen = True
            self.write("first_step", step)
        self.step = step
        if losses:
            self.loss = losses.get('loss', next(iter(losses.values())))
        if time.time() - self.row_time >= self.interval:
            self.write()

    def write(self, event: str = None, step: int = None, **fields) -> None:
        with self._lock:
            self._write(event, step, fields)

    def _write(self, event, step, fields) -> None:
        if step is not None:
            self.step = step
        now = time.time()
        # load and first-step rows report memory and time, and leave the s/it bookkeeping alone
        timing_only = event in ("load", "phase", "first_step", "memory_plan", "compile_blocks", "sample_start", "sample")
        s_per_it = None
        if not timing_only and self.step is not None and self.row_step is not None and self.step > self.row_step:
            s_per_it = (now - self.row_time) / (self.step - self.row_step)
        row = {"time": round(now, 3), "step": self.step, "loss": number(self.loss), "s_per_it": number(s_per_it)}
        row.update(vram())
        row["host_rss_gib"] = round(self.process.memory_info().rss / GIB, 3) if self.process else None
        peak = peak_rss_bytes()
        row["host_peak_rss_gib"] = round(peak / GIB, 3) if peak is not None else None
        if event:
            row["event"] = event
        if event == "first_step":
            row["since_start_s"] = round(now - self.started, 3)
        streaming = sys.modules.get("toolkit.block_streaming")
        if streaming is not None:  # bytes copied onto the device per step, when a plan streams blocks
            row.update(streaming.telemetry_fields())
        row.update(fields)
        if not timing_only:
            self.row_time, self.row_step = now, self.step
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()

    def sample_while_loading(self) -> None:
        """A "load" row every interval (a second at interval 0) from a daemon thread until training starts."""
        if self._loading is not None:
            return
        self._loading = threading.Event()
        stop = self._loading

        def loop():
            while not stop.wait(self.interval or LOAD_SAMPLE_AT_INTERVAL_ZERO_S):
                _safely(lambda: self.write("load"))

        self._sampler = threading.Thread(target=loop, name="telemetry-load", daemon=True)
        self._sampler.start()

    def stop_sampling(self) -> None:
        """Stop the "load" rows; a row being written is finished first."""
        if self._loading is not None:
            self._loading.set()
            self._sampler.join(timeout=10)


def number(value):
    """A float for JSON; None when unknown or not finite (JSON has no NaN)."""
    if value is None or not math.isfinite(float(value)):
        return None
    return round(float(value), 6)


def vram() -> dict:
    import torch

    if not torch.cuda.is_available():
        return dict.fromkeys(("vram_allocated_gib", "vram_reserved_gib", "vram_max_allocated_gib",
                              "vram_alloc_retries", "host_pinned_gib"))
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    pinned = host.get("allocated_bytes.current")
    return {
        "vram_allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
        "vram_reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
        "vram_max_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
        "vram_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
        "host_pinned_gib": round(pinned / GIB, 3) if pinned is not None else None,
    }


_telemetry = False  # False: off until `configure` is handed a telemetry_file


def rank_path(path: str) -> str:
    """The main rank of a `--gpus N` run (torchrun's RANK) writes `path`, which `run`, `plot` and
    `report` read; rank R writes `<stem>.rank<R>.jsonl` beside it: each card's VRAM, host RSS and s/it."""
    rank = os.environ.get("RANK", "0")
    return path if rank == "0" else rank_file(path, int(rank))


def configure(model_kwargs: dict) -> None:
    """Telemetry as the run's config says (the train process, once its model config is read)."""
    global _telemetry
    path = read(model_kwargs, "telemetry_file")
    _telemetry = TrainerTelemetry(rank_path(path), float(read(model_kwargs, "telemetry_interval_s"))) if path else False


def _get():
    return _telemetry


def _safely(call) -> None:
    global _telemetry
    try:
        call()
    except Exception as error:  # telemetry must never stop a training run
        print(f"Telemetry off: writing {_telemetry.path} failed: {error}", flush=True)
        _telemetry = False


def record_step(step: int, losses: dict) -> None:
    """After a trained step: `step` steps done, the step's losses; writes a row when due."""
    telemetry = _get()
    if telemetry:
        _safely(lambda: telemetry.on_step(step, losses))


def record_event(event: str, step: int = None, **fields) -> None:
    """A row now, whatever the interval: "start" (step = where training starts), "save",
    "sample_start" / "sample" around in-training samples (`fields`: their seconds and images), or
    "memory_plan" (`fields`: the plan carried out)."""
    telemetry = _get()
    if telemetry:
        if event == "start":
            telemetry.stop_sampling()
        _safely(lambda: telemetry.write(event, step, **fields))


class LoadPhase:
    """A load phase being timed ("text_encoder", "transformer", ...); end() writes its row."""

    def __init__(self, name: str):
        self.name = name
        self.began = time.time()

    def end(self, **info) -> None:
        """A "phase" row with the duration and the figures given (e.g. source="cache")."""
        telemetry = _get()
        if telemetry:
            seconds = round(time.time() - self.began, 3)
            _safely(lambda: telemetry.write("phase", phase={"name": self.name, "seconds": seconds, **info}))


def start_phase(name: str) -> LoadPhase:
    """Start timing a load phase; until training starts a "load" row is written every interval."""
    telemetry = _get()
    if telemetry:
        _safely(telemetry.sample_while_loading)
    return LoadPhase(name)
