"""In-trainer telemetry: one JSON line at most every AITK_TELEMETRY_INTERVAL seconds (default 10)
appended to the file named by AITK_TELEMETRY, plus a row at the start of training and after
each checkpoint save (a stall watchdog uses saves as a trigger).

VRAM is read here, in the training process: on ROCm/Windows a second process reading
torch.cuda.mem_get_info() sees ~0 GB in use while the trainer holds 20 GB. Each row is
appended and flushed on its own, so a crash loses at most the row being written. Without
AITK_TELEMETRY nothing is opened and each call returns at once.

    {"time": unix seconds, "step": steps done, "loss": float, "s_per_it": mean since last row,
     "vram_allocated_gib", "vram_reserved_gib", "vram_max_allocated_gib": null without a GPU,
     "host_rss_gib", "event": "start" | "save" (event rows only)}
"""

import json
import math
import os
import time

GIB = 2 ** 30


class TrainerTelemetry:
    def __init__(self, path: str, interval: float):
        self.path = path
        self.interval = interval
        self.step = None
        self.loss = None
        self.row_time = time.time()
        self.row_step = None
        self.process = None
        try:
            import psutil
            self.process = psutil.Process()
        except Exception:
            pass

    def on_step(self, step: int, losses: dict) -> None:
        self.step = step
        if losses:
            self.loss = losses.get('loss', next(iter(losses.values())))
        if time.time() - self.row_time >= self.interval:
            self.write()

    def write(self, event: str = None, step: int = None) -> None:
        if step is not None:
            self.step = step
        now = time.time()
        s_per_it = None
        if self.step is not None and self.row_step is not None and self.step > self.row_step:
            s_per_it = (now - self.row_time) / (self.step - self.row_step)
        row = {"time": round(now, 3), "step": self.step, "loss": number(self.loss), "s_per_it": number(s_per_it)}
        row.update(vram())
        row["host_rss_gib"] = round(self.process.memory_info().rss / GIB, 3) if self.process else None
        if event:
            row["event"] = event
        self.row_time, self.row_step = now, self.step
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()


def number(value):
    """A float for JSON; None when unknown or not finite (JSON has no NaN)."""
    if value is None or not math.isfinite(float(value)):
        return None
    return round(float(value), 6)


def vram() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"vram_allocated_gib": None, "vram_reserved_gib": None, "vram_max_allocated_gib": None}
    return {
        "vram_allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
        "vram_reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
        "vram_max_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
    }


_telemetry = None  # None: not set up yet; False: off


def _get():
    global _telemetry
    if _telemetry is None:
        path = os.environ.get("AITK_TELEMETRY")
        # one writer per run: the main process of a multi-GPU run
        main = os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"
        if path and main:
            _telemetry = TrainerTelemetry(path, float(os.environ.get("AITK_TELEMETRY_INTERVAL") or 10))
        else:
            _telemetry = False
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


def record_event(event: str, step: int = None) -> None:
    """A row now, whatever the interval: "start" (step = where training starts) or "save"."""
    telemetry = _get()
    if telemetry:
        _safely(lambda: telemetry.write(event, step))
