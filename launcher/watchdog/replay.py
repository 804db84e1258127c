"""Stall traces: replay a recorded trace through the policy, and synthesise runs with stalls.

`replay()` feeds a trace (the watchdog's own watchdog-trace.jsonl, or the run telemetry rows)
to a fresh policy and returns its decisions: with the thresholds the run used it reproduces
the run's events; with others it shows what they would have done (bursts recorded in the
trace report their recorded results; a trace without any assumes every burst worked).

`simulate()` runs the real watchdog loop against a simulated card and trainer, with a fake
clock: healthy stretches, stalls that a good burst clears, a stall that persists, burst
processes that start degraded (duds), checkpoint saves. It writes what a real run would: the
trainer's tqdm lines go through the real StepTracker, the telemetry rows every interval, the
trace and the events. `default_scenario()` is the 2000-step run the README's plot shows.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from launcher.signals.gpu_sources import GpuSample, GpuSource
from launcher.signals.trainer_log import Progress, Saved
from launcher.watchdog.loop import Watchdog
from launcher.watchdog.policy import BurstResult, Policy, WatchdogConfig
from launcher.user_files import UserFileError, json_row, open_regular
from launcher.writer import new_file, write_new

TRACE_LINE = 2**20
"""A trace row is a few hundred bytes; a longer line is not a trace (a file of NULs has no newline)."""

# --- traces ------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    """The rows of a trace a user names: a regular file of JSON objects, no line over TRACE_LINE bytes
    (a FIFO, /dev/zero or a file of NULs is refused with its name, not read without end)."""
    rows = []
    with open_regular(path) as handle:
        for number, line in enumerate(iter(lambda: handle.readline(TRACE_LINE + 1), b""), 1):
            if len(line) > TRACE_LINE:
                raise UserFileError(Path(path), f"line {number} is over {TRACE_LINE:,} bytes, and a trace row is a "
                                                "few hundred: is it the right file?")
            if not line.strip():
                continue
            row = json_row(line)
            if not isinstance(row, dict):
                raise UserFileError(Path(path), f"line {number} is not a JSON object; a trace is one object a line "
                                                "(watchdog-trace.jsonl or telemetry.jsonl)")
            rows.append(row)
    return rows


def write_jsonl(rows, path: Path) -> Path:
    """A new JSONL file (an `--out` of the watchdog command: never over a file)."""
    with new_file(Path(path), text=True) as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    return Path(path)


def trace_items(rows: list[dict]) -> list:
    """Policy inputs from trace rows. Rows with `kind` are watchdog traces; rows without it are
    telemetry rows (GPU fields, and step / s_it / loss, one row per interval)."""
    items: list = []
    last_step = None
    for row in rows:
        kind, t = row.get("kind"), row.get("t")
        if t is None:
            continue
        if kind == "progress":
            items.append(Progress(t=t, step=row["step"], s_it=row.get("s_it"), loss=row.get("loss")))
        elif kind == "save":
            items.append(Saved(t=t, step=row["step"]))
        elif kind == "burst_result":
            items.append(BurstResult(t=t, ok=row["ok"], tflops=row.get("tflops") or 0.0,
                                     seconds=row.get("seconds") or 0.0, error=row.get("error")))
        elif kind in (None, "gpu"):
            step = row.get("step")
            if kind is None and step is not None and step != last_step:
                last_step = step
                items.append(Progress(t=t, step=step, s_it=row.get("s_it"), loss=row.get("loss")))
            if kind is None and row.get("saved_step") is not None:
                items.append(Saved(t=t, step=row["saved_step"]))
            sample = GpuSample.from_row(row)
            if sample is not None:
                items.append(sample)
    return items


def replay(items: list, config: WatchdogConfig, assume_tflops: float = 70.0) -> list[dict]:
    """The policy's decisions on recorded inputs, ticking it at every recorded time."""
    policy = Policy(config)
    recorded_bursts = any(isinstance(item, BurstResult) for item in items)
    events: list[dict] = []
    pending_result: BurstResult | None = None

    def run(new: list[dict]) -> None:
        nonlocal pending_result
        events.extend(new)
        for event in new:
            if event["kind"] == "burst" and not recorded_bursts:
                end = event["t"] + config.burst_s
                pending_result = BurstResult(t=end, ok=True, tflops=assume_tflops, seconds=config.burst_s)

    index = 0
    while index < len(items):
        t = items[index].t
        while pending_result is not None and pending_result.t <= t:
            result, pending_result = pending_result, None
            run(policy.feed(result))
            run(policy.tick(result.t))
        while index < len(items) and items[index].t == t:
            run(policy.feed(items[index]))
            index += 1
        run(policy.tick(t))
    return events


# --- the simulated card and trainer -------------------------------------------------------------

@dataclass(frozen=True)
class Episode:
    """A stall starting when the trainer reaches `start_step` (after that step's save, if any).

    clears: a good burst ends it (or reaching `end_step`); persists: only `end_step` ends it.
    `duds`: how many burst processes started during the episode come up degraded."""

    start_step: int
    kind: str = "clears"
    s_it: float = 60.0
    end_step: int | None = None
    duds: int = 0


@dataclass(frozen=True)
class Scenario:
    steps: int = 2000
    healthy_s_it: float = 9.5
    save_every: int = 250
    save_s: float = 15.0
    burst_startup_s: float = 6.0
    good_tflops: float = 72.0
    dud_tflops: float = 7.5
    episodes: tuple[Episode, ...] = ()
    seed: int = 0
    name: str = "synthetic_flux2_512"


def default_scenario() -> Scenario:
    """2000 steps at 9.5 s/it with every case the watchdog handles, in order."""
    return Scenario(episodes=(
        Episode(140, "clears", s_it=55.0),                 # a stall; one burst clears it
        Episode(500, "clears", s_it=80.0),                 # right after a save: stalls cluster there
        Episode(820, "clears", s_it=45.0, duds=2),         # the first two burst processes are duds
        Episode(1420, "clears", s_it=118.0),               # the worst rate of the write-up
        Episode(1760, "persists", s_it=65.0, end_step=1830),  # bursts do not help: self-disable
    ))


class SimWorld:
    """The card and the trainer, advanced one second at a time by the fake clock."""

    def __init__(self, scenario: Scenario, config: WatchdogConfig) -> None:
        self.s = scenario
        self.config = config
        self.random = random.Random(scenario.seed)
        self.now = 0.0
        self.step = 0
        self.bar_elapsed = 0.0
        self.progress = 0.0
        self.saving_left = 0.0
        self.episode: Episode | None = None
        self.duds_left = 0
        self.lines: list[str] = []
        self.last_s_it: float | None = None
        self.loss: float | None = None
        self.burst_end: float | None = None
        self.burst_load_from: float | None = None
        self.done = False
        self._episodes = {episode.start_step: episode for episode in scenario.episodes}
        self.lines.append(self._bar_line(0, None))

    @property
    def stalled(self) -> bool:
        return self.episode is not None

    def advance(self, seconds: float) -> None:
        for _ in range(int(seconds)):
            self._second()

    def _second(self) -> None:
        self.now += 1.0
        if self.done:
            return
        if self.saving_left > 0:
            self.saving_left -= 1
            if self.saving_left <= 0:
                self._maybe_stall()
            return
        s_it = self.episode.s_it if self.episode else self.s.healthy_s_it
        self.progress += 1.0 / s_it
        self.bar_elapsed += 1.0
        if self.progress >= 1.0:
            self.progress -= 1.0
            self._finish_step()

    def _finish_step(self) -> None:
        self.step += 1
        jitter = self.random.gauss(0, 0.03)
        self.loss = 0.3 * math.exp(-self.step / 700) + 0.22 + self.random.gauss(0, 0.04)
        self.lines.append(self._bar_line(self.step, jitter))
        episode = self.episode
        if episode is not None and episode.end_step is not None and self.step >= episode.end_step:
            self.episode = None
        if self.step >= self.s.steps:
            self.done = True
            self.lines.append("\n")
            return
        if self.step % self.s.save_every == 0:
            self.lines.append(f"\nSaving at step {self.step}\n")
            self.lines.append(f"Saved checkpoint to /runs/{self.s.name}/{self.s.name}_{self.step:09d}.safetensors\n")
            self.saving_left = self.s.save_s
        else:
            self._maybe_stall()

    def _maybe_stall(self) -> None:
        episode = self._episodes.pop(self.step, None)
        if episode is not None:
            self.episode = episode
            self.duds_left = episode.duds

    def _bar_line(self, n: int, jitter: float | None) -> str:
        elapsed = int(self.bar_elapsed)
        clock = f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}" if elapsed >= 3600 \
            else f"{elapsed // 60:02d}:{elapsed % 60:02d}"
        if jitter is None:
            rate, postfix = "?it/s", ""
        else:
            s_it = (self.episode.s_it if self.episode else self.s.healthy_s_it) * (1 + jitter)
            rate, postfix = f"{s_it:.2f}s/it", f", lr: 1.0e-04 loss: {self.loss:.3e}"
        percent = int(100 * n / self.s.steps)
        return f"\r{self.s.name}: {percent:3d}%|          | {n}/{self.s.steps} [{clock}<?, {rate}{postfix}]"

    def gpu_sample(self) -> GpuSample:
        r = self.random
        vram = 23050 + r.uniform(-150, 150)
        if self.burst_load_from is not None and self.now >= self.burst_load_from:
            return GpuSample(self.now, r.gauss(2450, 25), r.gauss(402, 6), 100.0, r.uniform(40, 55), vram + 600)
        if self.saving_left > 0 or self.done:
            return GpuSample(self.now, r.gauss(700, 80), r.gauss(75, 8), r.uniform(0, 8), r.uniform(0, 2), vram)
        if self.stalled:
            return GpuSample(self.now, r.gauss(3100, 25), r.uniform(220, 260), r.uniform(94, 100), r.uniform(2, 7), vram)
        return GpuSample(self.now, r.gauss(2500, 30), r.gauss(385, 7), r.uniform(97, 100), r.uniform(23, 52), vram)


class SimSource(GpuSource):
    name = "simulated card"

    def __init__(self, world: SimWorld) -> None:
        super().__init__(note=lambda message: None, clock=lambda: world.now)
        self.world = world

    def _sample(self) -> GpuSample:
        return self.world.gpu_sample()


class SimBurster:
    """Burst processes on the simulated card: a start-up, the burst, then the result; a good
    burst ends a stall episode of kind `clears`."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world
        self.running: dict | None = None
        self.started: list[float] = []

    def start(self, now: float) -> None:
        world = self.world
        dud = world.duds_left > 0 and world.stalled
        if dud:
            world.duds_left -= 1
        seconds = world.config.burst_s
        self.running = {"end": now + world.s.burst_startup_s + seconds, "dud": dud, "seconds": seconds}
        world.burst_load_from = now + world.s.burst_startup_s
        self.started.append(now)

    def poll(self, now: float) -> BurstResult | None:
        running = self.running
        if running is None or now < running["end"]:
            return None
        self.running = None
        self.world.burst_load_from = None
        rate = self.world.s.dud_tflops if running["dud"] else self.world.s.good_tflops
        rate *= 1 + self.world.random.uniform(-0.04, 0.04)
        episode = self.world.episode
        if not running["dud"] and episode is not None and episode.kind == "clears":
            self.world.episode = None
        return BurstResult(t=now, ok=True, tflops=rate, seconds=running["seconds"])

    def stop(self) -> None:
        self.running = None


@dataclass
class Simulation:
    events: list[dict] = field(default_factory=list)
    trace: list[dict] = field(default_factory=list)
    telemetry: list[dict] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def write(self, out_dir: Path) -> dict[str, Path]:
        out_dir = Path(out_dir)
        write_new(out_dir / "train.log", "".join(self.log))
        return {
            "telemetry": write_jsonl(self.telemetry, out_dir / "telemetry.jsonl"),
            "trace": write_jsonl(self.trace, out_dir / "watchdog-trace.jsonl"),
            "events": write_jsonl(self.events, out_dir / "watchdog.jsonl"),
            "log": out_dir / "train.log",
        }


def simulate(scenario: Scenario, config: WatchdogConfig, max_hours: float = 24.0) -> Simulation:
    """Run the watchdog loop on the simulated run until the trainer finishes."""
    world = SimWorld(scenario, config)
    result = Simulation()

    def lines() -> list[str]:
        new, world.lines = world.lines, []
        result.log.extend(new)
        return new

    watchdog = Watchdog(config, source=SimSource(world), lines=lines, burster=SimBurster(world),
                        events=result.events.append, clock=lambda: world.now, trace=result.trace.append)
    while not world.done and world.now < max_hours * 3600:
        world.advance(config.interval_s)
        recorded = len(result.trace)
        watchdog.poll_once()
        last = watchdog.tracker.last
        for row in result.trace[recorded:]:
            if row["kind"] == "gpu":  # what the run telemetry writes every interval
                result.telemetry.append({
                    "t": row["t"], "step": last.step if last else 0, "loss": _round(last and last.loss),
                    "s_it": _round(last and last.s_it),
                    **{key: round(value, 3) for key, value in row.items() if key not in ("kind", "t")},
                })
    return result


def _round(value):
    return None if value is None else round(value, 4)

