"""The stall watchdog's brain: thresholds, the stall detector and the burst policy.

docs/recipe.md, "The stall": on the 7900 XTX the trainer drops at random from ~9 s/it into a state
of up to ~118 s/it that only board power tells apart: the core clock goes UP (~3100 MHz vs
~2500), board power goes DOWN (220-260 W vs ~385 W) and the memory controller idles (2-7 % vs
23-52 %). A fresh second process running large bf16 GEMMs for ~25 s flips the card back.

Everything here is pure: `Policy.feed(item)` takes one input (a GpuSample, a trainer Progress
or Saved, a BurstResult), `Policy.tick(now)` runs the timers, and both return the decisions as
JSONL-ready events. No clock is read and nothing sleeps, so tests replay traces with a fake
clock. launcher.watchdog.loop turns the "burst" events into processes.

Event kinds: baseline (saturated reference learnt), stall / clear (signature starts / ends),
hold (a stall waits for the cooldown), burst (start a burst process: trigger stall,
prophylactic-start, prophylactic-save or respawn), burst_done, dud, restored, not_restored,
skip (a prophylactic burst made redundant), disabled.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, fields

from launcher.errors import LauncherError
from launcher.signals.gpu_sources import GpuSample
from launcher.signals.trainer_log import Progress, Saved
from launcher.suggest import did_you_mean

XTX_SATURATED = {"clock_mhz": 2500.0, "power_w": 385.0, "mem_load": 35.0}
"""The 7900 XTX training at full speed (docs/recipe.md: ~2500 MHz, ~385 W, 23-52 % memory load)."""


@dataclass(frozen=True)
class WatchdogConfig:
    """The preset's `launcher: watchdog:` block. Defaults are the 7900 XTX numbers of docs/recipe.md."""

    enabled: bool = False
    """On in the ROCm presets; the policy runs only when the run enables it."""
    interval_s: float = 10.0
    """Seconds between GPU samples (the recipe's telemetry logger sampled every 10 s)."""
    source: str = "auto"
    """GPU telemetry tool: auto, amd-smi, rocm-smi, nvidia-smi or typeperf."""
    gpu: int = 0
    """GPU index for the telemetry tool."""
    rank_stall_s: float = 300.0
    """`run --gpus N`: a rank that keeps the others waiting this long in the gradient all-reduce is
    stalled (launcher/watchdog/rank_watch.py; on whether `enabled` or not); under NCCL's 10 minutes."""

    # --- detector
    samples: int = 2
    """Consecutive samples the signature must hold (the recipe: 2 samples = 20 s)."""
    baseline: dict | None = field(default_factory=lambda: dict(XTX_SATURATED))
    """The saturated state {clock_mhz, power_w, mem_load}; null = learn it from this run only."""
    learn_baseline: bool = True
    """Replace `baseline` by the run's own high-power samples once `learn_samples` exist."""
    learn_samples: int = 6
    clock_ratio: float = 1.10
    """Stalled needs clock >= 1.10 x baseline: 2750 MHz; stalled runs ~3100, saturated ~2500."""
    power_ratio: float = 0.75
    """... and power <= 0.75 x baseline: 289 W; stalled draws 220-260 W, saturated ~385 W."""
    mem_ratio: float = 0.35
    """... and memory load <= 0.35 x baseline: 12 %; stalled shows 2-7 %, saturated 23-52 %."""
    slow_ratio: float = 2.0
    """Without board power (Windows counters): a stall is s/it >= 2 x the healthy s/it."""
    healthy_s_it: float | None = None
    """The healthy step time; null = the 25th percentile of this run's unstalled steps."""

    # --- rescue
    burst_s: float = 25.0
    """Length of one burst (the recipe's ~25 s)."""
    burst_m: int = 6144
    burst_k: int = 6144
    burst_n: int = 18432
    burst_dtype: str = "auto"
    """auto = bf16 on a GPU (the recipe), float32 on a CPU (tests)."""
    burst_device: str = "cuda"
    """torch device of the burst process ("cuda" is also ROCm's name)."""
    burst_timeout_s: float = 240.0
    """A burst process still alive this long after its start is killed and counted a dud."""
    dud_tflops: float = 11.0
    """Below this the burst process started degraded (the recipe: < ~11 on a ~77 TFLOP/s card)."""
    max_respawns: int = 3
    """Duds in a row that are respawned at once; then the attempt counts as a failed burst."""
    prophylactic_after_start_s: float | None = 60.0
    """A burst this long after the first training step (null: none)."""
    prophylactic_after_save_s: float | None = 60.0
    """A burst this long after each checkpoint save, where stalls cluster (null: none)."""
    cooldown_s: float = 60.0
    """Seconds from the end of one burst to the start of the next (respawns excepted)."""

    # --- self-check
    verify_steps: int = 2
    """Steps measured after a burst (the step that straddles the burst is skipped)."""
    verify_timeout_s: float = 300.0
    """Without steps this long after a burst, judge it by the GPU signature alone."""
    restore_ratio: float = 1.5
    """A burst restored the rate when the median s/it after it <= 1.5 x healthy."""
    max_failed_bursts: int = 3
    """This many bursts in a row that do not restore the rate disable the watchdog."""


def load_config(block: dict | None) -> WatchdogConfig:
    """A config from a preset's `launcher: watchdog:` block; unknown keys name the closest one."""
    block = dict(block or {})
    known = {item.name for item in fields(WatchdogConfig)}
    for key in block:
        if key not in known:
            hint = did_you_mean(key, known) or f"; known keys: {', '.join(sorted(known))}"
            raise LauncherError(f"unknown key `{key}` in launcher: watchdog:{hint}")
    baseline = block.get("baseline", XTX_SATURATED)
    if baseline is not None:
        missing = {"clock_mhz", "power_w", "mem_load"} - set(baseline)
        if missing:
            raise LauncherError(f"launcher: watchdog: baseline needs {', '.join(sorted(missing))} (or null to learn it)")
        block["baseline"] = {key: float(baseline[key]) for key in ("clock_mhz", "power_w", "mem_load")}
    return WatchdogConfig(**block)


@dataclass(frozen=True)
class BurstResult:
    """What a burst process reported (or why it did not)."""

    t: float
    ok: bool
    tflops: float = 0.0
    seconds: float = 0.0
    error: str | None = None


def stall_signature(sample: GpuSample, baseline: dict, config: WatchdogConfig) -> bool | None:
    """True when the sample shows the stall relative to the saturated baseline; None when the
    sample lacks clock, power or memory load."""
    if sample.clock_mhz is None or sample.power_w is None or sample.mem_load is None:
        return None
    return (
        sample.clock_mhz >= baseline["clock_mhz"] * config.clock_ratio
        and sample.power_w <= baseline["power_w"] * config.power_ratio
        and sample.mem_load <= baseline["mem_load"] * config.mem_ratio
    )


def _percentile(values, fraction: float) -> float:
    ordered = sorted(values)
    return ordered[int(fraction * (len(ordered) - 1))]


class Policy:
    """Decides bursts from the inputs; keeps its state, does no I/O and reads no clock."""

    def __init__(self, config: WatchdogConfig) -> None:
        self.config = config
        self.now = 0.0
        self.step: int | None = None
        self.started_t: float | None = None
        self.baseline = dict(config.baseline) if config.baseline else None
        self.power_seen = False
        self.in_stall = False
        self.disabled: str | None = None
        self.failed_in_row = 0
        self._evidence = 0
        self._last_stalled: bool | None = None
        self._hold_logged = False
        self._window: deque[GpuSample] = deque(maxlen=360)
        self._healthy: deque[float] = deque(maxlen=60)
        self._running: dict | None = None
        self._last_start: float | None = None
        self._last_end: float | None = None
        self._verify: dict | None = None
        self._pending: dict | None = None
        self._learnt_once = False

    # --- inputs

    def feed(self, item) -> list[dict]:
        self.now = max(self.now, item.t)
        if isinstance(item, GpuSample):
            return self._on_sample(item)
        if isinstance(item, Progress):
            return self._on_progress(item)
        if isinstance(item, Saved):
            return self._on_saved(item)
        if isinstance(item, BurstResult):
            return self._on_result(item)
        raise TypeError(f"the watchdog cannot read {item!r}")

    def tick(self, now: float) -> list[dict]:
        """Run the timers: verification timeout, due prophylactic bursts, waiting stalls."""
        self.now = max(self.now, now)
        out: list[dict] = []
        verify = self._verify
        if verify is not None and self.now - verify["end"] >= self.config.verify_timeout_s:
            out += self._judge(not self.in_stall, f"no step rate {self.config.verify_timeout_s:.0f} s after the burst; "
                               f"the stall signature is {'held' if self.in_stall else 'clear'}")
        out += self._due_prophylactic()
        out += self._stall_burst()
        return out

    @property
    def healthy_s_it(self) -> float | None:
        if self.config.healthy_s_it is not None:
            return self.config.healthy_s_it
        return _percentile(self._healthy, 0.25) if len(self._healthy) >= 5 else None

    # --- handlers

    def _on_sample(self, sample: GpuSample) -> list[dict]:
        if sample.power_w is not None:
            self.power_seen = True
        if self._running is not None or self.started_t is None:
            return []  # the burst's own load is on the card, or the trainer is still loading
        if sample.clock_mhz is None or sample.power_w is None or sample.mem_load is None:
            return []  # no power signature on this platform; the step rate stands in
        out = self._learn(sample)
        if self.baseline is None:
            return out
        stalled = bool(stall_signature(sample, self.baseline, self.config))
        self._last_stalled = stalled
        numbers = {
            "clock_mhz": sample.clock_mhz, "power_w": sample.power_w, "mem_load": sample.mem_load,
            **{f"baseline_{key}": value for key, value in self.baseline.items()},
        }
        return out + self._evidence_update(stalled, numbers, "the power signature")

    def _on_progress(self, progress: Progress) -> list[dict]:
        out: list[dict] = []
        self.step = progress.step
        if self.started_t is None:
            self.started_t = progress.t
            if self.config.prophylactic_after_start_s is not None:
                self._schedule("prophylactic-start", self.config.prophylactic_after_start_s, "training started")
        if progress.s_it is None:
            return out
        s_it = progress.s_it
        healthy = self.healthy_s_it
        if self._verify is not None:
            if self._verify["skip"] > 0:
                self._verify["skip"] -= 1
            else:
                self._verify["values"].append(s_it)
                if len(self._verify["values"]) >= self.config.verify_steps:
                    out += self._judge_rate()
            return out
        slow = healthy is not None and s_it >= healthy * self.config.slow_ratio
        if self._running is None and not self.in_stall and not slow and self._last_stalled is not True:
            self._healthy.append(s_it)
        if not self.power_seen and healthy is not None and self._running is None:
            numbers = {"s_it": s_it, "healthy_s_it": healthy}
            out += self._evidence_update(slow, numbers, "the slow step rate")
        return out

    def _on_saved(self, saved: Saved) -> list[dict]:
        self.step = saved.step
        if self.config.prophylactic_after_save_s is not None and self.started_t is not None:
            self._schedule("prophylactic-save", self.config.prophylactic_after_save_s,
                           f"checkpoint saved at step {saved.step}")
        return []

    def _on_result(self, result: BurstResult) -> list[dict]:
        run = self._running
        if run is None:
            return []  # a recorded result that this policy never asked for (replay with other thresholds)
        self._running = None
        self._last_end = result.t
        numbers = {"tflops": result.tflops, "seconds": result.seconds, "dud_tflops": self.config.dud_tflops}
        if result.ok and result.tflops >= self.config.dud_tflops:
            self._verify = {"end": result.t, "skip": 1, "values": [], "cause": run["cause"]}
            self._evidence, self.in_stall, self._last_stalled = 0, False, None
            return [self._event("burst_done", f"{result.tflops:.1f} TFLOP/s for {result.seconds:.0f} s", **numbers)]
        why = result.error or f"{result.tflops:.1f} TFLOP/s is below {self.config.dud_tflops:g}"
        out = [self._event("dud", why, **numbers)]
        if run["respawn"] < self.config.max_respawns and self.disabled is None:
            respawn = run["respawn"] + 1
            out.append(self._start("respawn", f"respawn {respawn}/{self.config.max_respawns} after a dud",
                                   cause=run["cause"], respawn=respawn))
        else:
            out += self._fail(f"{run['respawn'] + 1} burst processes in a row were duds")
        return out

    # --- detector state

    def _learn(self, sample: GpuSample) -> list[dict]:
        """Learn the saturated baseline from the run's highest-power samples."""
        if not self.config.learn_baseline:
            return []
        self._window.append(sample)
        if len(self._window) < self.config.learn_samples:
            return []
        top_power = _percentile([item.power_w for item in self._window], 0.9)
        top = [item for item in self._window if item.power_w >= 0.9 * top_power]
        if len(top) < max(1, self.config.learn_samples // 2):
            return []
        learnt = {
            "clock_mhz": statistics.median(item.clock_mhz for item in top),
            "power_w": statistics.median(item.power_w for item in top),
            "mem_load": statistics.median(item.mem_load for item in top),
        }
        given = self.config.baseline
        probe = GpuSample(t=sample.t, **learnt)
        if given is not None and stall_signature(probe, given, self.config):
            return []  # the run has only seen stalled samples so far: keep the preset's baseline
        previous, self.baseline = self.baseline, learnt
        if not self._learnt_once or abs(learnt["power_w"] - previous["power_w"]) > 0.1 * previous["power_w"]:
            self._learnt_once = True
            return [self._event("baseline", f"learnt from {len(top)} high-power samples", **learnt)]
        return []

    def _evidence_update(self, stalled: bool, numbers: dict, what: str) -> list[dict]:
        out: list[dict] = []
        if stalled:
            self._evidence += 1
            if self._evidence >= self.config.samples and not self.in_stall:
                self.in_stall = True
                self._hold_logged = False
                out.append(self._event("stall", f"{what} held for {self._evidence} samples", **numbers))
                if self._verify is not None:
                    out += self._judge(False, "the stall came back after the burst")
        else:
            if self.in_stall:
                out.append(self._event("clear", f"{what} is gone", **numbers))
            self._evidence, self.in_stall = 0, False
        return out + self._stall_burst()

    # --- bursts

    def _can_burst(self) -> str | None:
        """Why no burst may start now, or None when one may."""
        if self.disabled is not None:
            return "disabled"
        if self._running is not None:
            return "a burst is running"
        if self._verify is not None:
            return "the last burst is being verified"
        if self._last_end is not None and self.now < self._last_end + self.config.cooldown_s:
            return f"cooldown: {self._last_end + self.config.cooldown_s - self.now:.0f} s left"
        return None

    def _stall_burst(self) -> list[dict]:
        if not self.in_stall:
            return []
        blocked = self._can_burst()
        if blocked is None:
            return [self._start("stall", "the stall signature holds")]
        if blocked != "disabled" and not self._hold_logged and self._running is None:
            self._hold_logged = True
            return [self._event("hold", blocked)]
        return []

    def _schedule(self, trigger: str, delay: float, why: str) -> None:
        self._pending = {"trigger": trigger, "due": self.now + delay, "since": self.now, "why": why}

    def _due_prophylactic(self) -> list[dict]:
        pending = self._pending
        if pending is None or self.now < pending["due"]:
            return []
        if self.disabled is not None:
            self._pending = None
            return []
        if self._last_start is not None and self._last_start >= pending["since"]:
            self._pending = None
            return [self._event("skip", f"no {pending['trigger']} burst: one ran after {pending['why']}")]
        if self._can_burst() is not None:
            return []  # wait for the cooldown or the running burst
        self._pending = None
        late = self.now - pending["since"]
        return [self._start(pending["trigger"], f"{late:.0f} s after {pending['why']}")]

    def _start(self, trigger: str, why: str, cause: str | None = None, respawn: int = 0) -> dict:
        self._running = {"trigger": trigger, "cause": cause or trigger, "respawn": respawn}
        self._last_start = self.now
        self._hold_logged = True
        return self._event("burst", why, trigger=trigger, respawn=respawn, seconds=self.config.burst_s)

    # --- verification

    def _judge_rate(self) -> list[dict]:
        values = self._verify["values"]
        median = statistics.median(values)
        healthy = self.healthy_s_it
        numbers = {"s_it": median, "healthy_s_it": healthy}
        if healthy is None:
            return self._judge(not self.in_stall, f"{median:.1f} s/it after the burst; no healthy rate known, "
                               f"the stall signature is {'held' if self.in_stall else 'clear'}", **numbers)
        limit = healthy * self.config.restore_ratio
        return self._judge(median <= limit, f"{median:.1f} s/it after the burst, healthy {healthy:.1f} "
                           f"(limit {limit:.1f})", **numbers)

    def _judge(self, restored: bool, why: str, **numbers) -> list[dict]:
        self._verify = None
        if restored:
            self.failed_in_row = 0
            return [self._event("restored", why, **numbers)]
        return self._fail(why, **numbers)

    def _fail(self, why: str, **numbers) -> list[dict]:
        self._verify = None
        self.failed_in_row += 1
        out = [self._event("not_restored", why, failed_in_row=self.failed_in_row, **numbers)]
        if self.failed_in_row >= self.config.max_failed_bursts and self.disabled is None:
            self.disabled = (f"{self.failed_in_row} bursts in a row did not restore the step rate "
                             f"(last: {why}); bursts are off for the rest of this run")
            self._pending = None
            out.append(self._event("disabled", self.disabled))
        return out

    def _event(self, kind: str, reason: str, **numbers) -> dict:
        event = {"t": round(self.now, 3), "step": self.step, "kind": kind, "reason": reason}
        for key, value in numbers.items():
            event[key] = round(value, 3) if isinstance(value, float) else value
        return event
