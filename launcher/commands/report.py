"""`report`: one zip for a bug report from a new card: doctor, self-test, timed tiny steps, recent runs."""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.checkup import collect
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, venv_python
from launcher.errors import LauncherError
from launcher.field_report import Bundle, Scrubber, add_run, recent_runs
from launcher.progress import say, step
from launcher.selftest.verdict import load_result
from launcher.step_prediction import report as step_report
from launcher.writer import new_file

EXAMPLES = """examples:
  python -m launcher report                  # doctor, selftest, 2 timed steps of the tiny model, recent runs
  python -m launcher report --no-selftest --out bug.zip   # quicker: the stored self-test only
  python -m launcher report --preset presets/7900xtx_512.yaml --model-dir M --text-encoder T --dataset D
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("report", help="write one zip to attach to a bug report (paths and names scrubbed)",
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--out", type=Path, default=None,
                        help="the zip to write (default: flux2-report-<date>-<time>.zip here); never overwritten")
    parser.add_argument("--no-selftest", action="store_true",
                        help="carry the stored self-test instead of running it again (it takes a few minutes)")
    parser.add_argument("--preset", default=None,
                        help="also carry this preset's dry run: the rendered config, the plan and the choices of `auto`")
    for flag in ("--model-dir", "--text-encoder", "--dataset"):
        parser.add_argument(flag, default=None, help=f"passed to the preset's dry run as {flag}")
    parser.set_defaults(handler=run_report)


def run_report(args) -> int:
    workdir = Workdir(args.workdir.resolve())
    workdir.check_is_folder()
    out = (args.out or Path(f"flux2-report-{time.strftime('%Y%m%d-%H%M%S')}.zip")).absolute()  # a link stays one
    if not out.parent.is_dir():
        raise LauncherError(f"the folder of --out {out} does not exist; create it or give another --out")
    with new_file(out) as handle:  # an existing file or a link there is refused before any work
        bundle = Bundle(handle, Scrubber.for_machine(workdir.root))
        gather(bundle, workdir, args)
        bundle.close()
    say(f"wrote {out} ({len(bundle.entries)} files, paths and names scrubbed): attach it to the bug report")
    return 0


def gather(bundle: Bundle, workdir: Workdir, args) -> None:
    launcher = [sys.executable, "-m", "launcher"]
    with step("doctor"):
        doctor = collect(workdir)
        bundle.add_json("doctor.json", doctor)
    has_trainer = venv_python(workdir.venv).is_file() and (workdir.trainer / "run.py").is_file()
    if has_trainer and not args.no_selftest:
        record(bundle, "selftest", [*launcher, "selftest", "--workdir", str(workdir.root)], "a few minutes")
    selftest = load_result(workdir)
    if selftest is not None:
        bundle.add_json("selftest.json", selftest)
    if has_trainer:
        with tempfile.TemporaryDirectory(prefix="flux2-report-") as scratch:
            record(bundle, "tiny", [*launcher, "run", "tiny", "--workdir", str(workdir.root), "--output", scratch],
                   "about a minute on a CPU")
            for run in recent_runs(Path(scratch), 1):
                add_run(bundle, run, "tiny")
    if args.preset:
        places = [part for flag in ("model_dir", "text_encoder", "dataset") if getattr(args, flag)
                  for part in (f"--{flag.replace('_', '-')}", getattr(args, flag))]
        record(bundle, "preset-dry-run", [*launcher, "run", args.preset, "--workdir", str(workdir.root), "--dry-run",
                                          *places], "seconds")
    runs = recent_runs(workdir.runs)
    for index, run in enumerate(runs):
        add_run(bundle, run, f"runs/{index}-{run.root.name}")
    add_prediction(bundle, doctor, runs)


def add_prediction(bundle: Bundle, doctor: dict, runs: list) -> None:
    """The card's predicted step range (bench/RESULTS.md) and each recent run's s/it against it, said here too."""
    names = [gpu["name"] for gpu in doctor["torch"].get("gpus") or []]
    found = step_report(names, runs)
    if found["predicted"]:
        bundle.add_json("prediction.json", found)
        for run in found["runs"]:
            if run["verdict"]:
                say(f"{run['run']}: {run['verdict']}")


def record(bundle: Bundle, name: str, command: list[str], how_long: str) -> None:
    """Run one launcher command, keep its output and exit code and time in the bundle; a failure is
    a finding for the report, not a reason to stop it."""
    with step(f"{name} ({how_long})"):
        began = time.monotonic()
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8",
                                errors="replace")
        seconds = round(time.monotonic() - began, 1)
    bundle.add_text(f"{name}.log", result.stdout)
    bundle.add_json(f"{name}.json", {"command": command[1:], "exit_code": result.returncode, "seconds": seconds})
    if result.returncode != 0:
        say(f"{name} exited with {result.returncode}; its output is in the report ({name}.log)")

