"""`python -m launcher selftest`: test the 4-bit kernels on this machine's GPU and keep the verdict.

Only the command line is here; the self-test is in launcher/selftest/ (running it, the stored
verdict that `qtype: auto`, `stream_mode: auto` and in-training sampling follow, the printed
report) and launcher/in_trainer/selftest/ (what runs under the trainer venv's interpreter).
"""

import argparse
import json
from pathlib import Path

from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir
from launcher.selftest import launch
from launcher.selftest.report import format_report


EXAMPLES = """examples:
  python -m launcher selftest                # kernels, quality gate, tiny steps, timings; writes selftest.json
  python -m launcher selftest --preset 7900xtx_768 --json
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("selftest", help="test the 4-bit kernels on this GPU; `qtype: auto` follows it",
                                   description=__doc__.splitlines()[0],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--preset", help="time at this preset's resolutions and batch (default: 512 px, batch 1)")
    parser.add_argument("--json", action="store_true", help="print the JSON result instead of the report")
    parser.set_defaults(handler=run_selftest)


def run_selftest(args) -> int:
    workdir = Workdir(args.workdir.resolve())
    report = launch.run(workdir, args.preset)
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        print("\n".join(format_report(report, workdir.selftest)), flush=True)
    return 0
