"""Plots of a run, drawn by `launcher.in_trainer.plot` in the trainer's venv (it has matplotlib).

Both sides read the rows with `launcher.in_trainer.plot.read_rows`: the launcher to say which
lines it leaves out, the trainer venv's plot to draw the rest. A line that is not a JSON object, or
whose figures are not numbers (a damaged or hand-edited file), is left out rather than ending the
plot in a traceback.
"""

from pathlib import Path

from launcher.envs.trainer_python import run_module
from launcher.in_trainer.plot import read_rows

__all__ = ["plot_with", "read_rows", "skipped_note"]


def plot_with(python: Path, telemetry_jsonl: Path, events_jsonl: Path | None, out_png: Path,
              sheet: Path | None = None) -> int:
    """Draw the plot with the trainer venv's interpreter; its exit code."""
    args = [str(Path(telemetry_jsonl).resolve()), str(Path(out_png).resolve())]
    if events_jsonl is not None:
        args += ["--events", str(Path(events_jsonl).resolve())]
    if sheet is not None:
        args += ["--sheet", str(Path(sheet).resolve())]
    return run_module(python, "plot", *args).returncode


def skipped_note(path: Path, skipped: list[str], events: bool = False) -> str:
    """One line saying which lines of `path` the plot leaves out."""
    what = "watchdog event" if events else "telemetry"
    many = len(skipped) > 1
    rows = f"are not {what} rows" if many else f"is not a {what} row"
    return (f"skipped {len(skipped)} line{'s' if many else ''} of {path} that {rows} ({skipped[0]}"
            f"{', and more' if many else ''}); the plot leaves {'them' if many else 'it'} out")
