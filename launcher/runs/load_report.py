"""The trainer's peak host RSS and the time of each load phase, from its telemetry rows, into run.json.

The trainer writes a "phase" row when a load phase ends (text encoder, transformer from the
file or the quantized cache), a "first_step" row with the seconds since its process started,
and its peak RSS (VmHWM / PeakWorkingSetSize) in every row. Whether a run needs a pagefile,
and how long a relaunch takes to train, are read here and kept beside the LoRA.
"""

import json
from pathlib import Path

from launcher.runs.folders import RunFolder
from launcher.user_files import UserFileError, json_row, load_json, open_regular
from launcher.writer import replace_own

ROWS_CAP = 64 * 2**20
"""A launch's rows are a few MB; a file grown past this (or one planted there) is read no further."""


def read_rows(path: Path, offset: int = 0) -> list[dict]:
    """Every complete JSON row of a JSONL file from byte `offset` on (where this launch began;
    a resumed run appends to the same file), up to ROWS_CAP bytes. A line still being written, or
    one that is not a JSON object, is skipped; a file that is not a regular file has no rows."""
    try:
        with open_regular(path) as handle:
            handle.seek(offset)
            data = handle.read(ROWS_CAP)
    except UserFileError:
        return []
    rows = [json_row(line) for line in data.splitlines()]
    return [row for row in rows if isinstance(row, dict)]


def summarize(rows: list[dict]) -> dict:
    """{"host_peak_rss_gib", "phases": {name: {"seconds", ...}}, "to_first_step_s", "memory_plan"};
    unknowns left out."""
    summary: dict = {}
    peaks = [row["host_peak_rss_gib"] for row in rows if isinstance(row.get("host_peak_rss_gib"), (int, float))]
    if peaks:
        summary["host_peak_rss_gib"] = max(peaks)
    phases = {}
    for row in rows:
        phase = row.get("phase")
        if row.get("event") == "phase" and isinstance(phase, dict) and "name" in phase:
            phases[phase["name"]] = {key: value for key, value in phase.items() if key != "name"}
    if phases:
        summary["phases"] = phases
    plans = [row["memory_plan"] for row in rows if row.get("event") == "memory_plan" and isinstance(row.get("memory_plan"), dict)]
    if plans:
        summary["memory_plan"] = plans[-1]
    first = next((row for row in rows if row.get("event") == "first_step"), None)
    if first is not None and first.get("since_start_s") is not None:
        summary["to_first_step_s"] = first["since_start_s"]
    return summary


def telemetry_offset(run: RunFolder) -> int:
    """Where the rows of the launch about to start will begin in the trainer's telemetry file."""
    return run.trainer_telemetry.stat().st_size if run.trainer_telemetry.is_file() else 0


def record(run: RunFolder, offset: int = 0) -> dict:
    """Add this launch's summary to run.json as "load", and its memory plan as "memory_plan"
    (replaced atomically); returns the summary."""
    summary = summarize(read_rows(run.trainer_telemetry, offset))
    if not summary or not run.metadata.is_file():
        return summary
    metadata = load_json(run.metadata, "metadata")
    if not isinstance(metadata, dict):
        return summary
    load = dict(summary)
    if "memory_plan" in load:  # the plan the trainer carried out, beside the load figures
        metadata["memory_plan"] = load.pop("memory_plan")
    metadata["load"] = load
    replace_own(run.metadata, json.dumps(metadata, indent=2) + "\n")
    return summary


def describe(summary: dict) -> str:
    """One line for the console: peak RSS, each phase, time to the first step."""
    parts = []
    if "host_peak_rss_gib" in summary:
        parts.append(f"peak host RSS {summary['host_peak_rss_gib']:.1f} GiB")
    for name, phase in summary.get("phases", {}).items():
        source = f" ({phase['source']})" if phase.get("source") else ""
        parts.append(f"{name} {phase.get('seconds', 0):.1f} s{source}")
    if "to_first_step_s" in summary:
        parts.append(f"first step after {summary['to_first_step_s']:.1f} s")
    return "; ".join(parts)
