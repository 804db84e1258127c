"""Loss, s/it and board power over steps, with every watchdog decision marked on the s/it curve,
and the trainer's host RSS over time (loading included), with the bytes a memory plan streams
per step; with `--sheet`, the run's newest contact sheet of samples beside the curves.

matplotlib lives in the trainer's venv, not the launcher's, so this runs there:
    <venv python> -m launcher.in_trainer.plot TELEMETRY.jsonl OUT.png [--events watchdog.jsonl] [--sheet PNG]
(`launcher.runs.plotting.plot_with(python, ...)` does that from the launcher). matplotlib is imported on use only.

Telemetry rows need `step` and any of `loss`, `s_it`, `power_w` (the run telemetry rows, or a
watchdog trace whose `progress` / `gpu` rows carry them); the memory panel reads `t`,
`trainer_time`, `host_rss_gib`, `host_peak_rss_gib` and `streamed_bytes_step` of the run telemetry rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

NUMBERS = ("t", "step", "loss", "s_it", "power_w", "host_rss_gib", "host_peak_rss_gib", "streamed_bytes_step",
           "trainer_time")
"""Figures the plot draws or orders by: a number or null."""
FINITE = ("t", "step", "trainer_time")
"""Figures the plot places points by: NaN or infinity there is damage, not a measurement."""
TEXTS = ("kind", "trigger")


TRIGGER_COLOURS = {
    "stall": "tab:red",
    "prophylactic-start": "tab:green",
    "prophylactic-save": "tab:green",
    "respawn": "tab:orange",
}
MARKERS = {  # kind -> (marker, colour, label)
    "stall": ("v", "tab:red", "stall detected"),
    "dud": ("x", "tab:orange", "dud burst (respawned)"),
    "not_restored": ("o", "tab:purple", "burst did not help"),
    "restored": ("^", "tab:green", "rate restored"),
}


def _rows(path: Path | None, events: bool = False) -> list[dict]:
    """The file's rows; lines that are not rows are left out (the launcher says which)."""
    return read_rows(path, events)[0]


HISTORY_BYTES = 64 * 2**20
"""The most of a telemetry file read: a day of rows is a few MB; a planted 1 GiB file is not read whole."""


def read_rows(path: Path | None, events: bool = False) -> tuple[list[dict], list[str]]:
    """The rows of a telemetry (or, with `events`, a watchdog) JSONL file, and why each line left out
    was ("line 3: not JSON"). A last line without its newline is a row still being written: it is
    left out without a word unless it is complete. Of a file over HISTORY_BYTES only the end is read,
    from its first whole line, numbered from there."""
    if path is None or not Path(path).is_file():
        return [], []
    with Path(path).open("rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(max(0, size - HISTORY_BYTES))
        data = handle.read(HISTORY_BYTES)
    if size > HISTORY_BYTES:
        data = data.partition(b"\n")[2]
    lines = data.decode("utf-8", errors="replace").split("\n")
    rows, skipped = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row, why = _row(line, events)
        if why is None:
            rows.append(row)
        elif not (number == len(lines) and why == "not JSON"):
            skipped.append(f"line {number}: {why}")
    return rows, skipped


def _row(line: str, events: bool) -> tuple[dict | None, str | None]:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: a line nested thousands of levels deep
        return None, "not JSON"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object"
    for key in NUMBERS:
        value = row.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (key in FINITE and not math.isfinite(value)):
            return None, f"{key} is {_short(value)}, not a number"
    for key in TEXTS:
        if row.get(key) is not None and not isinstance(row[key], str):
            return None, f"{key} is {_short(row[key])}, not text"
    if events and (row.get("kind") is None or row.get("step") is None):
        return None, f"an event without {'kind' if row.get('kind') is None else 'step'}"
    return row, None


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """(steps, values) for loss, s/it (one value per step, the last seen) and power."""
    per_step: dict[str, dict[int, float]] = {"loss": {}, "s_it": {}}
    power: tuple[list, list] = ([], [])
    step = 0
    for row in rows:
        if row.get("step") is not None:
            step = row["step"]
        for key in per_step:
            if row.get(key) is not None and row.get("kind") in (None, "progress"):
                per_step[key][step] = row[key]
        if row.get("power_w") is not None:
            power[0].append(step)
            power[1].append(row["power_w"])
    out = {key: (sorted(values), [values[s] for s in sorted(values)]) for key, values in per_step.items()}
    out["power_w"] = power
    return out


def memory_series(rows: list[dict]) -> dict[str, list]:
    """Host RSS, its peak and the GiB streamed per step over minutes since the first row, one
    point per trainer sample, and the minute training started (the first row with a step), or None."""
    out: dict[str, list] = {"minutes": [], "rss": [], "peak": [], "streamed": []}
    seen = set()
    start = next((row["t"] for row in rows if row.get("t") is not None), None)
    first_step = None
    for row in rows:
        if row.get("host_rss_gib") is None or row.get("t") is None or row.get("trainer_time") in seen:
            continue
        seen.add(row.get("trainer_time"))
        minute = (row["t"] - start) / 60
        out["minutes"].append(minute)
        out["rss"].append(row["host_rss_gib"])
        out["peak"].append(row.get("host_peak_rss_gib"))
        out["streamed"].append((row.get("streamed_bytes_step") or 0) / 2 ** 30)
        if first_step is None and row.get("step"):
            first_step = minute
    out["first_step"] = first_step
    return out


def plot_memory(axis, rows: list[dict]) -> None:
    memory = memory_series(rows)
    axis.plot(memory["minutes"], memory["rss"], lw=0.9, color="tab:purple", label="host RSS")
    peaks = [(m, p) for m, p in zip(memory["minutes"], memory["peak"]) if p is not None]
    if peaks:
        axis.plot(*zip(*peaks), lw=0.8, ls="--", color="tab:gray", label="peak host RSS")
    if memory["first_step"] is not None:
        axis.axvline(memory["first_step"], color="black", lw=0.8, ls=":", label="first step")
    axis.set_ylabel("host RAM (GiB)")
    axis.set_xlabel("minutes since launch")
    if memory["minutes"]:
        axis.legend(loc="lower right", fontsize=7)
    if any(memory["streamed"]):  # a memory plan that streams blocks: the bytes copied per step
        streamed = axis.twinx()
        streamed.plot(memory["minutes"], memory["streamed"], lw=0.8, color="tab:cyan", label="streamed per step")
        streamed.set_ylabel("streamed per step (GiB)")
        streamed.legend(loc="lower left", fontsize=7)


def plot_run(telemetry_jsonl: Path, events_jsonl: Path | None, out_png: Path, sheet: Path | None = None) -> Path:
    """Write the PNG and return its path; `sheet` (a contact sheet) goes in a column on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(telemetry_jsonl)
    data = series(rows)
    events = [event for event in _rows(events_jsonl, events=True) if event.get("step") is not None]
    figure = plt.figure(figsize=(19 if sheet else 13, 11.5))
    grid = figure.add_gridspec(4, 2 if sheet else 1, height_ratios=[1, 1.6, 1, 1],
                               width_ratios=[2, 1] if sheet else [1])
    loss_ax = figure.add_subplot(grid[0, 0])
    rate_ax = figure.add_subplot(grid[1, 0], sharex=loss_ax)
    power_ax = figure.add_subplot(grid[2, 0], sharex=loss_ax)
    plot_memory(figure.add_subplot(grid[3, 0]), rows)
    if sheet:
        sheet_ax = figure.add_subplot(grid[0:2, 1])
        sheet_ax.imshow(plt.imread(sheet))
        sheet_ax.set_axis_off()
        sheet_ax.set_title(f"samples, step {Path(sheet).parent.name} (rows: prompts, columns: LoRA strengths)",
                           fontsize=9)
    loss_ax.plot(*data["loss"], lw=0.6, color="tab:blue")
    loss_ax.set_ylabel("loss")
    rate_ax.plot(*data["s_it"], lw=0.8, color="black", label="s/it")
    rate_ax.set_ylabel("s/it")
    if data["s_it"][1] and min(data["s_it"][1]) > 0:
        rate_ax.set_yscale("log")
    power_ax.plot(*data["power_w"], lw=0.5, color="tab:red")
    power_ax.set_ylabel("board power (W)")
    power_ax.set_xlabel("step")

    labelled: set[str] = set()

    def label(text: str) -> str | None:
        if text in labelled:
            return None
        labelled.add(text)
        return text

    top = max(data["s_it"][1], default=1.0)
    for event in events:
        kind, step = event["kind"], event["step"]
        if kind == "burst":
            trigger = event.get("trigger", "stall")
            name = "prophylactic" if trigger.startswith("prophylactic") else trigger
            rate_ax.axvline(step, color=TRIGGER_COLOURS.get(trigger, "tab:gray"), lw=0.9, alpha=0.8,
                            label=label(f"burst ({name})"))
        elif kind == "disabled":
            for axis in (loss_ax, rate_ax, power_ax):
                axis.axvline(step, color="black", lw=2, ls="--")
            rate_ax.text(step, top, " watchdog disabled", va="top", fontsize=8)
        elif kind in MARKERS:
            marker, colour, text = MARKERS[kind]
            rate_ax.scatter([step], [top], marker=marker, color=colour, zorder=3, label=label(text))
    if labelled or data["s_it"][0]:
        rate_ax.legend(loc="center right", fontsize=7, ncol=2, framealpha=0.9)
    counts = {kind: sum(1 for event in events if event["kind"] == kind) for kind in ("burst", "dud", "stall")}
    figure.suptitle(f"{Path(telemetry_jsonl).parent.name}: {counts['stall']} stalls, {counts['burst']} bursts "
                    f"({counts['dud']} duds)")
    figure.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, dpi=110)
    plt.close(figure)
    return out_png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.in_trainer.plot", description=__doc__.splitlines()[0])
    parser.add_argument("telemetry", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--events", type=Path, help="watchdog.jsonl whose decisions are marked")
    parser.add_argument("--sheet", type=Path, help="a contact sheet of samples to show beside the curves")
    args = parser.parse_args(argv)
    print(plot_run(args.telemetry, args.events, args.out, args.sheet), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
