"""Profile a few training steps with torch.profiler (`python -m launcher run PRESET --profile N`).

With model_kwargs profile_steps: N (and profile_dir, the folder to write to: `run --profile N` writes
both), the train loop profiles N whole steps (data loading, forward, backward, optimizer, logging)
after profile_skip warm-up steps (default 2: the first steps compile and autotune kernels and
grow the allocator). Then it writes, into profile_dir:

  trace.json   the Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev)
  top20.txt    the 20 operators with the most self time on the GPU (on the CPU without one),
               then the 20 with the most CPU time, and a summary: wall time of the window, the
               GPU's busy time within it, and what is left (host overhead, syncs, data loading)
  breakdown.json  milliseconds per step by category (block GEMMs, requantization, attention,
               elementwise, LoRA matmuls, optimizer, copies) and by phase, GPU busy and idle
               time, data wait (toolkit/step_breakdown.py); its table ends top20.txt

and prints the summary. With profile_steps 0 (the default) each call returns at once. A failure to
profile or to write is reported and never stops the training.
"""

import json
import os
import time

from flux2_contract.files import PROFILE_BREAKDOWN, PROFILE_DIR, PROFILE_TABLE, PROFILE_TRACE
from flux2_contract.settings import read
from toolkit import step_breakdown


class StepProfiler:
    def __init__(self, steps: int, folder: str, skip: int):
        self.steps, self.folder, self.skip = steps, folder, skip
        self.seen = 0  # step starts seen so far
        self.profile = None
        self.started = None
        self.done = False

    def step_start(self) -> None:
        """Called at the top of every train-loop iteration."""
        if self.done:
            return
        if self.profile is None and self.seen == self.skip:
            self._start()
        elif self.profile is not None and self.seen == self.skip + self.steps:
            self.finish()
        self.seen += 1

    def _start(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        try:
            self.profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profile.start()
            self.started = time.perf_counter()
            print(f"[profile] profiling {self.steps} steps", flush=True)
        except Exception as error:  # the profiler is optional; training is not
            print(f"[profile] could not start the profiler: {error}", flush=True)
            self.profile, self.done = None, True

    def finish(self) -> None:
        """Stop and write the files (at the start of step skip + N, or when training ends)."""
        if self.profile is None or self.done:
            return
        import torch

        self.done = True
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        try:
            self.profile.stop()
            os.makedirs(self.folder, exist_ok=True)
            trace = os.path.join(self.folder, PROFILE_TRACE)
            self.profile.export_chrome_trace(trace)
            steps = self.seen - self.skip
            result = step_breakdown.breakdown(step_breakdown.load_trace(trace), wall, steps)
            summary = step_breakdown.format_summary(result, gpu)
            write_tables(self.profile, summary, os.path.join(self.folder, PROFILE_TABLE), gpu)
            print(f"[profile] {summary}; wrote {PROFILE_TRACE} and {PROFILE_TABLE} to {self.folder}", flush=True)
            print(write_breakdown(self.folder, result), flush=True)
        except Exception as error:
            print(f"[profile] could not write the profile to {self.folder}: {error}", flush=True)


def write_tables(profile, summary: str, path: str, gpu: bool) -> None:
    """The summary line, then the two top-20 tables."""
    averages = profile.key_averages()
    device_key = "self_device_time_total" if gpu else "self_cpu_time_total"
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(summary + "\n\n")
        handle.write(f"top 20 by self {'GPU' if gpu else 'CPU'} time\n")
        handle.write(averages.table(sort_by=device_key, row_limit=20) + "\n")
        handle.write("top 20 by CPU time (operator and everything it calls)\n")
        handle.write(averages.table(sort_by="cpu_time_total", row_limit=20) + "\n")


def write_breakdown(folder: str, result: dict) -> str:
    """breakdown.json, its table appended to top20.txt; returns the table."""
    with open(os.path.join(folder, PROFILE_BREAKDOWN), "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    table = step_breakdown.format_table(result)
    with open(os.path.join(folder, PROFILE_TABLE), "a", encoding="utf-8") as handle:
        handle.write("\n" + table + "\n")
    return "[profile] " + table.replace("\n", "\n[profile] ")


_PROFILER = None


def configure(model_kwargs: dict) -> None:
    """The profiler as the run's config says (the train process, once its model config is read)."""
    global _PROFILER
    steps = read(model_kwargs, "profile_steps")
    folder = read(model_kwargs, "profile_dir") or os.path.join(os.getcwd(), PROFILE_DIR)
    _PROFILER = StepProfiler(steps, folder, read(model_kwargs, "profile_skip")) if steps else None


def step_start() -> None:
    if _PROFILER is not None:
        _PROFILER.step_start()


def training_done() -> None:
    """Called after the train loop: writes what was profiled if training ended first."""
    if _PROFILER is not None:
        _PROFILER.finish()
