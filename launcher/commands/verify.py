"""`verify`: is the checkout exactly the lock's commit plus the series, and nothing else?"""

from pathlib import Path

from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir
from launcher.patching import checkout, gitops, series
from launcher.patching.lock import find_target
from launcher.progress import say


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify", help="check that the trainer checkout matches upstream.lock and patches/"
    )
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.set_defaults(handler=run_verify)


def run_verify(args) -> int:
    gitops.require_git()
    workdir = Workdir(args.workdir.resolve())
    target = find_target(checkout.read_state(workdir.state_file).get("target"), args.lock)
    patches = series.load_checked(target.series)
    drift = checkout.problems(workdir.trainer, target, patches)
    if drift:
        print(f"{workdir.trainer} drifted from upstream.lock ({target.name}):", flush=True)
        for problem in drift:
            print(f"  - {problem}", flush=True)
        return 1
    say(f"ok: {workdir.trainer} = {target.commit[:12]} + {len(patches)} patches, no other change")
    return 0
