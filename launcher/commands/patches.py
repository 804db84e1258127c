"""`patches check` and `patches export`: the maintainer's view of the series."""

import argparse
from pathlib import Path

import git

from launcher.errors import LauncherError
from launcher.patching import gitops, series
from launcher.patching.check import check
from launcher.patching.lock import find_target
from launcher.progress import say

CHECK_EXAMPLES = """examples:
  python -m launcher patches check                          # the first target at its locked commit
  python -m launcher patches check --target upstream-main --ref main --json
"""
EXPORT_EXAMPLES = """examples:
  python -m launcher patches export --repo .aitk/trainer    # after committing a fix in the checkout
New files of the checkout go to overlay/ (one copy for every target); the commits above the
overlay commit become the target's patches, with the series' comment lines kept.
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("patches", help="check or export the patch series",
                                   epilog=CHECK_EXAMPLES + EXPORT_EXAMPLES.split("\n", 1)[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    check = verbs.add_parser("check", help="apply the series in a scratch clone and report each patch",
                             epilog=CHECK_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("--target", help="a target name from upstream.lock (default: the first)")
    check.add_argument("--ref", help="commit, tag or branch to apply onto (default: the locked commit)")
    check.add_argument("--url", help="repository to clone (default: the target's url)")
    check.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    check.set_defaults(handler=run_check)

    export = verbs.add_parser(
        "export", help="write the commits above the locked commit of a checkout as the series",
        epilog=EXPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("--repo", type=Path, required=True, help="a checkout holding the series as commits")
    export.add_argument("--target", help="a target name from upstream.lock (default: the first)")
    export.add_argument("--head", default="HEAD", help="last commit of the series (default: HEAD)")
    export.set_defaults(handler=run_export)


def run_check(args) -> int:
    gitops.require_git()
    target = find_target(args.target, args.lock)
    return check(target, series.read_series(target.series), args.ref or target.commit, args.url or target.url,
                 as_json=args.json)


def run_export(args) -> int:
    gitops.require_git()
    target = find_target(args.target, args.lock)
    try:
        repo = git.Repo(args.repo)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise LauncherError(f"{args.repo} is not a git checkout") from None
    if not repo.is_ancestor(target.commit, args.head):
        raise LauncherError(
            f"{args.head} in {args.repo} is not built on the locked commit {target.commit[:12]}"
        )
    written = series.export_series(repo, target.commit, args.head, target.series, target.overlay, target.contract)
    for patch in written:
        say(f"  wrote {patch.path}")
    say(f"{len(written)} patches in {target.series}; hashes in {series.HASH_FILE}")
    return 0
