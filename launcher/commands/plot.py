"""`plot RUN`: a PNG of loss, s/it and board power over steps, with watchdog decisions marked, and
the run's newest contact sheet of samples beside them when it has one."""

import argparse
from pathlib import Path

from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, venv_python
from launcher.errors import LauncherError
from launcher.nofollow import refuse_links
from launcher.progress import say, warn
from launcher.runs.folders import find_run
from launcher.runs.plotting import plot_with, read_rows, skipped_note
from launcher.writer import staged


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
    out = args.out.absolute() if args.out else run.root / "telemetry.png"
    folder = out.parent
    refuse_links(folder, out)  # a link at the PNG's name (a planted one could lead to a user's photo)
    if out.is_dir():
        raise LauncherError(f"{out} is a folder; give --out a .png file name")
    events = run.watchdog_events if run.watchdog_events.is_file() else None
    for path, is_events in ((run.telemetry, False), (events, True)):
        skipped = read_rows(path, events=is_events)[1]
        if skipped:
            warn(skipped_note(path, skipped, events=is_events))
    sheets = sorted(run.samples.glob("*/contact_sheet.png"), key=lambda p: p.stat().st_mtime)
    # matplotlib opens the name it is given and follows a link there: it draws into the writer's fresh
    # temporary file, which then becomes the PNG; a user's --out never replaces a file, the run's own plot does
    with staged(out, folder, replace=args.out is None) as temporary:
        if plot_with(python, run.telemetry, events, temporary, sheets[-1] if sheets else None) != 0:
            raise LauncherError(f"plotting {run.telemetry} failed; the error is above")
    say(f"wrote {out}")
    return 0
