"""GPU samples behind one small interface: amd-smi, rocm-smi, nvidia-smi, Windows counters.

The run telemetry and the stall watchdog both read the GPU through `GpuSource.sample()`, which
returns one `GpuSample` or None. Each tool is run as a subprocess with an argument list (no
shell) and its output goes through a pure `parse_*` function, so the parsers are tested on
captured outputs without the tool. A missing or failing tool is reported once through `note`
and the source then yields nothing: telemetry must never stop a six-hour run.

Why not `torch.cuda.mem_get_info()` from a second process: on ROCm/Windows it reports ~0 GB in
use while the trainer holds 20 GB (docs/recipe.md, wall 10). VRAM here comes from the driver's tools.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

FIELDS = ("clock_mhz", "power_w", "gpu_util", "mem_load", "vram_used_mb")
"""The measured fields of a sample; telemetry rows and traces use these names."""


@dataclass(frozen=True)
class GpuSample:
    """One reading. Any field the platform does not expose is None."""

    t: float
    """Seconds, from the clock the source was given (wall time by default)."""
    clock_mhz: float | None = None
    """Graphics core clock."""
    power_w: float | None = None
    """Board (socket) power."""
    gpu_util: float | None = None
    """Graphics engine busy, percent."""
    mem_load: float | None = None
    """Memory-controller load (amd-smi umc_activity, NVML utilization.memory), percent."""
    vram_used_mb: float | None = None

    def to_row(self) -> dict:
        """A JSONL row: `t` plus the fields that are known."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_row(cls, row: dict) -> "GpuSample | None":
        """A sample from a telemetry or trace row, or None when the row holds no GPU field."""
        if not any(row.get(name) is not None for name in FIELDS) or row.get("t") is None:
            return None
        return cls(t=float(row["t"]), **{name: _number(row.get(name)) for name in FIELDS})


Note = Callable[[str], None]


def _stderr_note(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _number(value) -> float | None:
    """A float from the many shapes the tools print: 385, "385.0", "385 W", "(2500Mhz)",
    {"value": 385, "unit": "W"}; None for "N/A", "[Not Supported]" and the like."""
    if isinstance(value, dict):
        value = value.get("value")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    match = re.search(r"-?\d+(?:\.\d+)?", str(value))
    return float(match.group()) if match else None


class GpuSource:
    """Base of every source: `sample()` returns a GpuSample or None, never raises."""

    name = "gpu"

    def __init__(self, note: Note = _stderr_note, clock: Callable[[], float] = time.time) -> None:
        self.note = note
        self.clock = clock
        self.disabled_reason: str | None = None

    def sample(self) -> GpuSample | None:
        if self.disabled_reason is not None:
            return None
        try:
            return self._sample()
        except Exception as error:  # a telemetry source must never take the run down
            self.disable(f"{type(error).__name__}: {error}")
            return None

    def disable(self, reason: str) -> None:
        """Report once, then yield nothing."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            self.note(f"GPU telemetry from {self.name} is off: {reason}")

    def _sample(self) -> GpuSample | None:
        raise NotImplementedError


class CommandSource(GpuSource):
    """A source that runs a tool and parses its standard output."""

    tool = ""
    timeout_s = 15.0

    def __init__(self, device: int = 0, note: Note = _stderr_note, clock=time.time, executable: str | None = None):
        super().__init__(note, clock)
        self.device = device
        self.executable = executable or shutil.which(self.tool)

    def command(self) -> list[str]:
        raise NotImplementedError

    def parse(self, text: str, t: float) -> GpuSample | None:
        raise NotImplementedError

    def _sample(self) -> GpuSample | None:
        if self.executable is None:
            self.disable(f"`{self.tool}` is not on PATH")
            return None
        t = self.clock()
        try:
            result = subprocess.run(
                self.command(), capture_output=True, text=True, timeout=self.timeout_s,
                encoding="utf-8", errors="replace",
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            self.disable(f"`{self.tool}` could not run ({error})")
            return None
        if result.returncode != 0:
            last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            self.disable(f"`{self.tool}` exited with {result.returncode}: {last[0]}")
            return None
        sample = self.parse(result.stdout, t)
        if sample is None:
            self.disable(f"`{self.tool}` printed nothing this launcher can read for GPU {self.device}")
        return sample


# --- amd-smi (Linux ROCm 6.1 and later) -------------------------------------------------------

def parse_amd_smi(text: str, device: int = 0, t: float = 0.0) -> GpuSample | None:
    """`amd-smi metric --json` -> sample. Accepts the bare list (ROCm 6.1-6.3) and the
    {"gpu_data": [...]} wrapper (6.4 and later); values as numbers, strings or {value, unit}."""
    data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("gpu_data", [data])
    entry = next((item for item in data if item.get("gpu", 0) == device), None)
    if entry is None:
        return None
    usage = entry.get("usage") or {}
    power = entry.get("power") or {}
    clock = entry.get("clock") or {}
    gfx_clock = clock.get("gfx_0") or clock.get("GFX_0") or {}
    memory = entry.get("mem_usage") or {}
    return GpuSample(
        t=t,
        clock_mhz=_number(gfx_clock.get("clk") if isinstance(gfx_clock, dict) else gfx_clock),
        power_w=_first(power, "socket_power", "average_socket_power", "current_socket_power"),
        gpu_util=_number(usage.get("gfx_activity")),
        mem_load=_number(usage.get("umc_activity")),
        vram_used_mb=_number(memory.get("used_vram")),
    )


def _first(mapping: dict, *keys: str) -> float | None:
    for key in keys:
        value = _number(mapping.get(key))
        if value is not None:
            return value
    return None


class AmdSmiSource(CommandSource):
    name = tool = "amd-smi"

    def command(self) -> list[str]:
        return [self.executable, "metric", "--usage", "--power", "--clock", "--mem-usage",
                "--gpu", str(self.device), "--json"]

    def parse(self, text: str, t: float) -> GpuSample | None:
        return parse_amd_smi(text, self.device, t)


# --- rocm-smi (older Linux ROCm) ----------------------------------------------------------------

def parse_rocm_smi(text: str, device: int = 0, t: float = 0.0) -> GpuSample | None:
    """`rocm-smi --showuse --showmemuse --showpower --showclocks --showmeminfo vram --json`.
    Key names moved between releases; each field tries the names seen so far."""
    data = json.loads(text)
    card = data.get(f"card{device}")
    if not isinstance(card, dict):
        return None
    used_bytes = _first(card, "VRAM Total Used Memory (B)")
    return GpuSample(
        t=t,
        clock_mhz=_first(card, "sclk clock speed:", "current_gfxclk (MHz)", "average_gfxclk_frequency (MHz)"),
        power_w=_first(
            card, "Average Graphics Package Power (W)", "Current Socket Graphics Package Power (W)",
            "average_socket_power (W)",
        ),
        gpu_util=_first(card, "GPU use (%)", "average_gfx_activity (%)"),
        mem_load=_first(card, "GPU Memory Read/Write Activity (%)", "GPU memory use (%)", "average_umc_activity (%)"),
        vram_used_mb=None if used_bytes is None else used_bytes / 2**20,
    )


class RocmSmiSource(CommandSource):
    name = tool = "rocm-smi"

    def command(self) -> list[str]:
        return [self.executable, "-d", str(self.device), "--showuse", "--showmemuse", "--showpower",
                "--showclocks", "--showmeminfo", "vram", "--json"]

    def parse(self, text: str, t: float) -> GpuSample | None:
        return parse_rocm_smi(text, self.device, t)


# --- NVML through nvidia-smi (no pynvml dependency) ---------------------------------------------

NVIDIA_QUERY = ("clocks.sm", "power.draw", "utilization.gpu", "utilization.memory", "memory.used")


def parse_nvidia_smi(text: str, t: float = 0.0) -> GpuSample | None:
    """`nvidia-smi --query-gpu=<NVIDIA_QUERY> --format=csv,noheader,nounits -i N` -> sample.
    utilization.memory is the memory-controller busy time; "[N/A]" fields become None."""
    rows = [row for row in csv.reader(io.StringIO(text)) if row]
    if not rows or len(rows[0]) < len(NVIDIA_QUERY):
        return None
    clock, power, util, mem_load, used = (_number(cell.strip()) for cell in rows[0][: len(NVIDIA_QUERY)])
    return GpuSample(t=t, clock_mhz=clock, power_w=power, gpu_util=util, mem_load=mem_load, vram_used_mb=used)


class NvidiaSmiSource(CommandSource):
    name = tool = "nvidia-smi"

    def command(self) -> list[str]:
        return [self.executable, f"--query-gpu={','.join(NVIDIA_QUERY)}", "--format=csv,noheader,nounits",
                "-i", str(self.device)]

    def parse(self, text: str, t: float) -> GpuSample | None:
        return parse_nvidia_smi(text, t)


# --- Windows GPU performance counters -----------------------------------------------------------

WINDOWS_COUNTERS = (
    r"\GPU Engine(*)\Utilization Percentage",
    r"\GPU Adapter Memory(*)\Dedicated Usage",
)
_LUID = re.compile(r"luid_(0x[0-9a-fA-F]+_0x[0-9a-fA-F]+)_phys_(\d+)")
_ENGINE = re.compile(r"engtype_([A-Za-z0-9]+)")


def parse_typeperf(text: str, t: float = 0.0, adapter: str | None = None) -> GpuSample | None:
    """`typeperf <WINDOWS_COUNTERS> -sc 1` CSV -> sample for one adapter.

    Windows exposes engine utilisation and dedicated VRAM per adapter, not clock, board power
    or memory-controller load: those stay None, and the watchdog falls back to the step rate.
    Utilisation is summed over the processes' 3D and Compute engines of the adapter (capped at
    100); with no `adapter` (the LUID, e.g. "0x00000000_0x0000D1F2") the busiest one is used.
    Counter names are the English ones; localized Windows installs print translated names.
    """
    rows = [row for row in csv.reader(io.StringIO(text)) if len(row) > 1]
    header = next((row for row in rows if row[0].startswith("(PDH-CSV")), None)
    samples = [row for row in rows if header is not None and row is not header and len(row) == len(header)]
    if not samples:
        return None  # typeperf's trailing "Exiting, please wait..." lines have another width
    values = samples[-1]
    util: dict[str, float] = {}
    vram: dict[str, float] = {}
    for name, cell in zip(header[1:], values[1:]):
        value = _number(cell)
        luid = _LUID.search(name)
        if value is None or luid is None:
            continue
        key = luid.group(1)
        if "\\Utilization Percentage" in name:
            engine = _ENGINE.search(name)
            if engine and (engine.group(1) == "3D" or engine.group(1).startswith("Compute")):
                util[key] = util.get(key, 0.0) + value
        elif "\\Dedicated Usage" in name:
            vram[key] = vram.get(key, 0.0) + value
    if adapter is None:
        candidates = util or vram
        if not candidates:
            return None
        adapter = max(candidates, key=lambda key: (util.get(key, 0.0), vram.get(key, 0.0)))
    if adapter not in util and adapter not in vram:
        return None
    used = vram.get(adapter)
    return GpuSample(
        t=t,
        gpu_util=min(util[adapter], 100.0) if adapter in util else None,
        vram_used_mb=None if used is None else used / 2**20,
    )


class WindowsCountersSource(CommandSource):
    """typeperf ships with every Windows; it samples over one second and prints CSV."""

    name = tool = "typeperf"

    def __init__(self, adapter: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.adapter = adapter

    def command(self) -> list[str]:
        return [self.executable, *WINDOWS_COUNTERS, "-sc", "1"]

    def parse(self, text: str, t: float) -> GpuSample | None:
        return parse_typeperf(text, t, self.adapter)


# --- choosing a source -------------------------------------------------------------------------

SOURCES = {
    "amd-smi": AmdSmiSource,
    "rocm-smi": RocmSmiSource,
    "nvidia-smi": NvidiaSmiSource,
    "typeperf": WindowsCountersSource,
}


def detect_source(preferred: str = "auto", device: int = 0, note: Note = _stderr_note,
                  windows: bool | None = None) -> GpuSource | None:
    """The first usable source for this platform ("auto"), or the named one; None when none
    exists (reported once through `note`). Order: amd-smi, rocm-smi, nvidia-smi on Linux;
    nvidia-smi, then the performance counters on Windows (AMD's tools are Linux-only)."""
    if windows is None:
        windows = os.name == "nt"
    if preferred != "auto":
        if preferred not in SOURCES:
            raise ValueError(f"unknown GPU source {preferred!r}; known: auto, {', '.join(SOURCES)}")
        return SOURCES[preferred](device=device, note=note)
    order = ("nvidia-smi", "typeperf") if windows else ("amd-smi", "rocm-smi", "nvidia-smi")
    for name in order:
        source = SOURCES[name](device=device, note=note)
        if source.executable is not None:
            return source
    note(f"no GPU telemetry tool found (looked for {', '.join(order)}); GPU fields stay empty")
    return None
