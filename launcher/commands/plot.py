"""`plot RUN`: a PNG of loss, s/it and board power over steps, with watchdog decisions marked, and
the run's newest contact sheet of samples beside them when it has one."""

import argparse
from pathlib import Path

from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, venv_python
from launcher.errors import LauncherError
from launcher.progress import say
from launcher.runs.folders import find_run
from launcher.runs.plotting import plot_with


EXAMPLES = """examples:
  python -m launcher plot                    # the latest run's telemetry -> <run>/telemetry.png
  python -m launcher plot my-run --out loss.png
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("plot", help="plot a run's telemetry (loss, s/it, power) to a PNG",
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="?", help="run folder or run name (default: the latest run)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run>/telemetry.png)")
    parser.set_defaults(handler=run_plot)


def run_plot(args) -> int:
    workdir = Workdir(args.workdir.resolve())
    run = find_run(workdir.runs, args.run)
    if not run.telemetry.is_file():
        raise LauncherError(f"{run.telemetry} does not exist: this run recorded no telemetry yet")
    python = venv_python(workdir.venv)
    if not python.is_file():
        raise LauncherError("plotting uses the trainer venv's matplotlib; run `python -m launcher setup` first")
    out = args.out or run.root / "telemetry.png"
    events = run.watchdog_events if run.watchdog_events.is_file() else None
    sheets = sorted(run.samples.glob("*/contact_sheet.png"), key=lambda p: p.stat().st_mtime)
    if plot_with(python, run.telemetry, events, out, sheets[-1] if sheets else None) != 0:
        raise LauncherError(f"plotting {run.telemetry} failed; the error is above")
    say(f"wrote {out}")
    return 0
