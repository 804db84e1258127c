"""The watchdog at work: every interval it reads the trainer log and the GPU, asks the policy,
starts burst processes, and writes each decision to the run's watchdog.jsonl.

The loop owns all I/O and takes its clock as an argument, so tests and the synthetic trace
drive it with a fake clock and fake sources (no sleeping). It also records every input it
gave the policy to a trace (watchdog-trace.jsonl); replaying that trace with
`python -m launcher watchdog replay` reproduces the decisions, or shows what other
thresholds would have decided.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from launcher.envs.trainer_python import module_command, start_module
from launcher.progress import say, warn
from launcher.signals.gpu_sources import GpuSample, GpuSource, detect_source
from launcher.signals.trainer_log import LogFollower, Progress, Saved, StepTracker
from launcher.watchdog.policy import BurstResult, Policy, WatchdogConfig
from launcher.writer import open_append

EVENTS_FILE = "watchdog.jsonl"
TRACE_FILE = "watchdog-trace.jsonl"
LOUD_KINDS = {"stall", "burst", "dud", "not_restored", "disabled"}


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a killed run keeps every row."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, row: dict) -> None:
        with open_append(self.path.parent, self.path, text=True) as out:
            out.write(json.dumps(row) + "\n")


def item_row(item) -> dict:
    """A policy input as a trace row (`kind` says which input)."""
    if isinstance(item, GpuSample):
        return {"kind": "gpu", **item.to_row()}
    if isinstance(item, Progress):
        return {"kind": "progress", "t": item.t, "step": item.step, "s_it": item.s_it, "loss": item.loss}
    if isinstance(item, Saved):
        return {"kind": "save", "t": item.t, "step": item.step}
    if isinstance(item, BurstResult):
        return {"kind": "burst_result", "t": item.t, "ok": item.ok, "tflops": item.tflops,
                "seconds": item.seconds, "error": item.error}
    raise TypeError(item)


class SubprocessBurster:
    """Runs each burst as a fresh `python -m launcher.in_trainer.burst` with the trainer's interpreter."""

    def __init__(self, python: Path, config: WatchdogConfig, env: dict[str, str] | None = None) -> None:
        self.python = Path(python)
        self.config = config
        self.env = env
        self._child: subprocess.Popen | None = None
        self._stderr = None
        self._started = 0.0
        self._failed: BurstResult | None = None

    def arguments(self) -> list[str]:
        c = self.config
        return ["--seconds", str(c.burst_s), "--device", c.burst_device,
                "--m", str(c.burst_m), "--k", str(c.burst_k), "--n", str(c.burst_n), "--dtype", c.burst_dtype]

    def command(self) -> list[str]:
        return module_command(self.python, "burst", *self.arguments())

    def start(self, now: float) -> None:
        self.stop()
        self._stderr = tempfile.TemporaryFile()
        self._started = now
        try:
            self._child = start_module(self.python, "burst", *self.arguments(), env=self.env,
                                       stdout=subprocess.PIPE, stderr=self._stderr)
        except OSError as error:
            self._child = None
            self._failed = BurstResult(t=now, ok=False, error=f"cannot start {self.python}: {error}")

    def poll(self, now: float) -> BurstResult | None:
        if self._failed is not None:
            failed, self._failed = self._failed, None
            return failed
        child = self._child
        if child is None:
            return None
        if child.poll() is None:
            if now - self._started < self.config.burst_timeout_s:
                return None
            self.stop()
            return BurstResult(t=now, ok=False, error=f"no result after {self.config.burst_timeout_s:.0f} s; killed")
        stdout = child.stdout.read().decode("utf-8", "replace")
        self._child = None
        return parse_burst_output(stdout, child.returncode, self._read_stderr(), now)

    def _read_stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        text = self._stderr.read().decode("utf-8", "replace")
        self._stderr.close()
        self._stderr = None
        return text

    def stop(self) -> None:
        """Kill the running burst process (our own child), if any."""
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
            self._child.wait()
        self._child = None
        self._read_stderr()


def parse_burst_output(stdout: str, returncode: int, stderr: str, now: float) -> BurstResult:
    """The burst's one JSON line -> BurstResult; anything else is a failed burst with a reason."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "ok" in data:
            return BurstResult(t=now, ok=bool(data["ok"]), tflops=float(data.get("tflops", 0.0)),
                               seconds=float(data.get("seconds", 0.0)), error=data.get("error"))
    tail = (stderr.strip().splitlines() or ["no output"])[-1]
    return BurstResult(t=now, ok=False, error=f"burst exited with {returncode} and no result: {tail}")


class Watchdog:
    """One `poll_once()` per interval: inputs -> policy -> actions and logged events."""

    def __init__(self, config: WatchdogConfig, *, source: GpuSource | None, lines: Callable[[], list[str]] | None,
                 burster, events: Callable[[dict], None], clock: Callable[[], float] = time.time,
                 trace: Callable[[dict], None] | None = None, loud: bool = False) -> None:
        self.config = config
        self.policy = Policy(config)
        self.tracker = StepTracker()
        self.source = source
        self.lines = lines
        self.burster = burster
        self.events = events
        self.clock = clock
        self.trace = trace
        self.loud = loud

    def poll_once(self) -> list[dict]:
        now = self.clock()
        items: list = []
        if self.lines is not None:
            for line in self.lines():
                items += self.tracker.feed(line, now)
        if self.source is not None:
            sample = self.source.sample()
            if sample is not None:
                items.append(sample)
        result = self.burster.poll(now)
        if result is not None:
            items.append(result)
        decided: list[dict] = []
        for item in items:
            if self.trace is not None:
                self.trace(item_row(item))
            decided += self._act(self.policy.feed(item))
        decided += self._act(self.policy.tick(now))
        return decided

    def _act(self, events: list[dict]) -> list[dict]:
        for event in events:
            self.events(event)
            if self.loud and event["kind"] in LOUD_KINDS:
                (warn if event["kind"] == "disabled" else say)(f"watchdog: {event['kind']} at step "
                                                             f"{event['step']}: {event['reason']}")
            if event["kind"] == "burst":
                self.burster.start(self.policy.now)
        return events

    def run(self, stop: threading.Event) -> None:
        """Poll every interval until `stop` is set; kills a running burst on the way out."""
        try:
            while not stop.is_set():
                self.poll_once()
                stop.wait(self.config.interval_s)
        finally:
            self.burster.stop()


@dataclass
class WatchdogThread:
    """A watchdog running beside the trainer; `stop()` ends it and any burst process."""

    watchdog: Watchdog
    thread: threading.Thread
    stop_event: threading.Event

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        self.thread.join(timeout)


def watch_run(config: WatchdogConfig, run_dir: Path, log: Path, python: Path,
              env: dict[str, str] | None = None) -> WatchdogThread:
    """Start the watchdog for one run: it follows `log` (the trainer's tee'd output), samples
    the GPU with the configured tool, bursts with the trainer's `python`, and writes
    watchdog.jsonl and watchdog-trace.jsonl into `run_dir`."""
    watchdog = Watchdog(
        config,
        source=detect_source(config.source, config.gpu, note=warn),
        lines=LogFollower(log).read_new,
        burster=SubprocessBurster(python, config, env),
        events=JsonlWriter(Path(run_dir) / EVENTS_FILE),
        trace=JsonlWriter(Path(run_dir) / TRACE_FILE),
        loud=True,
    )
    stop = threading.Event()
    thread = threading.Thread(target=watchdog.run, args=(stop,), name="stall-watchdog", daemon=True)
    thread.start()
    return WatchdogThread(watchdog, thread, stop)
