"""Plots of a run, drawn by `launcher.in_trainer.plot` in the trainer's venv (it has matplotlib)."""

from pathlib import Path

from launcher.envs.trainer_python import run_module


def plot_with(python: Path, telemetry_jsonl: Path, events_jsonl: Path | None, out_png: Path,
              sheet: Path | None = None) -> int:
    """Draw the plot with the trainer venv's interpreter; its exit code."""
    args = [str(Path(telemetry_jsonl).resolve()), str(Path(out_png).resolve())]
    if events_jsonl is not None:
        args += ["--events", str(Path(events_jsonl).resolve())]
    if sheet is not None:
        args += ["--sheet", str(Path(sheet).resolve())]
    return run_module(python, "plot", *args).returncode
