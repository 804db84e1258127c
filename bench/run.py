"""Run one measurement of bench/ by name and archive its raw output, dated, under bench/archive/.

    python -m bench.run --list                        # every scenario: script, where, tables it feeds
    python -m bench.run NAME --trainer W/trainer [--out OUT] [--dir BW] [-- more arguments]

From the repository root, with the interpreter the scenario's `python` says (the trainer venv
for the CPU scenarios that import the trainer). Arguments after `--` are appended to the
script's own (a repeated option overrides the scenario's value). When the script succeeds, each
file of the scenario's `outputs` is copied to archive/NAME_DATE.EXT (NAME_FILE_DATE.EXT when there
are several; an existing file is never overwritten); then add its figures to results/TABLE.csv
and run `python bench/report.py`.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    raise SystemExit("run it from the repository root as a module: python -m bench.run --list")

from bench.scenarios import ELSEWHERE, SCENARIOS, Scenario  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARCHIVE = REPO / "bench" / "archive"


def listing() -> str:
    lines = ["| scenario | measures | runs | where | python | feeds results/ |", "| --- | --- | --- | --- | --- | --- |"]
    for s in SCENARIOS.values():
        runs = " ".join(s.command) + (f" -- {s.needs}" if s.needs else "")
        lines.append(f"| `{s.name}` | {s.what} | `{runs}` | {s.where} | {s.python} | {', '.join(s.tables)} |")
    lines += [f"| (none) | table `{table}` | {source} | | | {table} |" for table, source in ELSEWHERE.items()]
    return "\n".join(lines)


def command(scenario: Scenario, places: dict, extra: list[str]) -> tuple[list[str], dict]:
    """The command line, placeholders filled; an error naming the option when one is missing."""
    def fill(text: str) -> str:
        for key, value in places.items():
            if "{" + key + "}" in text:
                if value is None:
                    raise SystemExit(f"scenario {scenario.name} needs --{key} (see python -m bench.run --list)")
                text = text.replace("{" + key + "}", str(value))
        return text

    head, *args = scenario.command
    if head == "bash":
        start = ["bash"]
    elif head.endswith(".py"):
        start = [sys.executable, "-u", str(REPO / head)]
    else:
        start = [sys.executable, "-u", "-m", head]
    return start + [fill(a) for a in args] + extra, {k: fill(v) for k, v in scenario.env}


def archive(scenario: Scenario, out: Path, day: str) -> list[Path]:
    """Copy each output of the scenario to archive/, dated; never over an existing file."""
    kept = []
    for name in scenario.outputs:
        source = out / name
        if not source.is_file():
            print(f"[bench.run] {source} was not written: nothing archived for it", file=sys.stderr)
            continue
        stem = scenario.name if len(scenario.outputs) == 1 else f"{scenario.name}_{source.stem}"
        target, n = ARCHIVE / f"{stem}_{day}{source.suffix}", 2
        while target.exists():
            target, n = ARCHIVE / f"{stem}_{day}_{n}{source.suffix}", n + 1
        shutil.copyfile(source, target)
        kept.append(target)
    return kept


def run(scenario: Scenario, cmd: list[str], env: dict, out: Path) -> int:
    """Run the script from the repository root, its output shown and kept in {out}/output.log."""
    rows = []
    with (out / "output.log").open("w", encoding="utf-8") as log:
        child = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in child.stdout:
            print(line, end="", flush=True)
            log.write(line)
            if scenario.stdout_rows and line.startswith("{"):
                try:
                    rows.append(json.dumps(json.loads(line)))
                except ValueError:
                    pass
    if rows:
        (out / "rows.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return child.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example:\n  W/venv/bin/python -m bench.run load_rss_depth --trainer W/trainer")
    parser.add_argument("name", nargs="?", help="the scenario (--list shows them)")
    parser.add_argument("--list", action="store_true", help="print the scenario table (markdown) and exit")
    parser.add_argument("--trainer", type=Path, help="the patched trainer checkout (W/trainer, .bench-carry/trainer)")
    parser.add_argument("--workdir", type=Path, help="a workdir made by python -m launcher setup")
    parser.add_argument("--out", type=Path, help="where the script's output goes (default: a new temporary folder)")
    parser.add_argument("--dir", type=Path, help="a scratch folder for checkpoints and caches (default: OUT/work)")
    parser.add_argument("--no-archive", action="store_true", help="a trial run: keep nothing under archive/")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args, extra = parser.parse_known_args(argv)
    extra = extra[1:] if extra[:1] == ["--"] else extra
    if args.list:
        print(listing())
        return 0
    if args.name not in SCENARIOS:
        parser.error(f"unknown scenario {args.name!r}: one of {', '.join(SCENARIOS)}")
    scenario = SCENARIOS[args.name]
    out = (args.out or Path(tempfile.mkdtemp(prefix=f"bench-{scenario.name}-"))).resolve()
    scratch = (args.dir or out / "work").resolve()
    places = {"trainer": args.trainer and args.trainer.resolve(), "workdir": args.workdir and args.workdir.resolve(),
              "out": out, "dir": scratch}
    cmd, env = command(scenario, places, extra)
    print(f"[bench.run] {scenario.name} ({scenario.where}): {' '.join(cmd)}" + (f"  env+{env}" if env else ""), flush=True)
    if args.dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    rc = run(scenario, cmd, env, out)
    if rc:
        print(f"[bench.run] {scenario.name} failed (exit {rc}); its output is in {out}", file=sys.stderr)
        return rc
    if args.no_archive:
        return 0
    for path in archive(scenario, out, time.strftime("%Y-%m-%d", time.gmtime())):
        print(f"[bench.run] archived {path.relative_to(REPO)}")
    if scenario.tables:
        print(f"[bench.run] next: its figures into bench/results/{{{','.join(scenario.tables)}}}.csv, "
              "then python bench/report.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
