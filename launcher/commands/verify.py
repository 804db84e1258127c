"""`verify`: is the checkout exactly the lock's commit, the overlay and the series, and nothing else?"""

import argparse
import json
from pathlib import Path

from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, read_state
from launcher.patching import checkout, gitops, overlay, series
from launcher.patching.lock import find_target
from launcher.progress import quiet_stdout, say

EXAMPLES = """examples:
  python -m launcher verify                      # the checkout in .aitk
  python -m launcher verify --workdir W --json   # one JSON object for a program to read
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify", help="check that the trainer checkout matches upstream.lock, overlay/ and patches/",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.set_defaults(handler=run_verify)


def run_verify(args) -> int:
    gitops.require_git()
    workdir = Workdir(args.workdir.resolve())
    with quiet_stdout(args.json):
        target = find_target(read_state(workdir.state_file).get("target"), args.lock)
        patches = series.load_checked(target.series)
        drift = checkout.problems(workdir.trainer, target, patches)
        files = overlay.trainer_files(target)
    if args.json:
        report = {"ok": not drift, "trainer": str(workdir.trainer), "target": target.name,
                  "commit": target.commit, "overlay_files": len(files),
                  "patches": [p.name for p in patches], "problems": drift}
        print(json.dumps(report, indent=2), flush=True)
    elif drift:
        print(f"{workdir.trainer} drifted from upstream.lock ({target.name}):", flush=True)
        for problem in drift:
            print(f"  - {problem}", flush=True)
    else:
        say(f"ok: {workdir.trainer} = {target.commit[:12]} + overlay ({len(files)} files) + "
            f"{len(patches)} patches, no other change")
    return 1 if drift else 0
