"""`rebase`: move a target's series onto a new upstream commit or tag."""

import argparse
import dataclasses
from pathlib import Path

from launcher.envs.workdir import DEFAULT_WORKDIR
from launcher.errors import LauncherError
from launcher.patching import gitops, series
from launcher.patching.check import check
from launcher.patching.lock import find_target
from launcher.patching.rebase import Rebase, write_lock_commit
from launcher.progress import say


EXAMPLES = """examples:
  python -m launcher rebase --onto origin/main --target upstream-main   # stops at the first conflict
  python -m launcher rebase --continue       # after resolving it in the scratch checkout
  python -m launcher rebase --onto v1.2 --write   # rewrite upstream.lock and the series when done
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "rebase",
        help="carry the patch series onto a new upstream commit, 3-way merging; stops on conflicts",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--onto", metavar="REF", help="commit, tag or branch of the upstream to rebase onto")
    action.add_argument("--continue", dest="resume", action="store_true", help="commit your resolution, go on")
    action.add_argument("--skip", action="store_true", help="drop the stopped patch (absorbed upstream)")
    action.add_argument("--abort", action="store_true", help="drop the rebase; nothing in the repo changes")
    parser.add_argument("--reason", default="absorbed upstream", help="why a --skip drops the patch")
    parser.add_argument("--target", help="a target name from upstream.lock (default: the first)")
    parser.add_argument("--url", help="repository to fetch REF from (default: the target's url)")
    parser.add_argument("--write", action="store_true",
                        help="on success, replace the target's series and its commit in upstream.lock")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.set_defaults(handler=run_rebase)


def run_rebase(args) -> int:
    gitops.require_git()
    target = find_target(args.target, args.lock)
    workdir = f'"{args.workdir}"' if " " in str(args.workdir) else str(args.workdir)
    rebase = Rebase(args.workdir.resolve() / "rebase" / target.name, f"--target {target.name} --workdir {workdir}")
    if args.abort:
        rebase.abort()
        return 0
    if args.onto:
        state = rebase.start(target, args.onto, args.url)
    else:
        state = rebase.state()
        if args.resume:
            rebase.resume(state)
        elif args.skip:
            rebase.skip(state, args.reason)
    if not rebase.advance(state):
        return 1
    return finish(args, rebase, state, target)


def finish(args, rebase: Rebase, state, target) -> int:
    """Export the rebased series, optionally write it and the lock, and check the result."""
    series_file = target.series if args.write else rebase.root / "series" / "series"
    overlay_dir = target.overlay if args.write or target.overlay is None else rebase.root / "series" / "overlay"
    contract_dir = target.contract if args.write or target.contract is None else rebase.root / "series" / target.contract.name
    patches = rebase.export(state, series_file, overlay_dir, contract_dir)
    say("summary:")
    for name in state.series:
        say(f"  {name}: {state.results.get(name, '?')}")
    if args.write:
        write_lock_commit(args.lock, target.name, state.onto)
        say(f"wrote {len(patches)} patches to {series_file.parent} and commit {state.onto[:12]} to {args.lock}")
    else:
        say(
            f"rebased series in {series_file.parent}; adopt it with "
            f"`{rebase.command('--continue --write')}`, or drop it with `{rebase.command('--abort')}`"
        )
    rebased = dataclasses.replace(target, commit=state.onto, series=series_file, overlay=overlay_dir,
                                  contract=contract_dir)
    status = check(rebased, series.load_checked(series_file), state.onto, args.url or target.url)
    if status != 0:
        raise LauncherError("the rebased series does not apply cleanly; this is a launcher bug, please report it")
    if args.write:  # without --write the finished rebase waits for `--continue --write`
        gitops.remove_tree(rebase.checkout)
        rebase.state_file.unlink()
    return 0
