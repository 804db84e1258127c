"""`patches check` and `patches export`: the maintainer's view of the series."""

import argparse
import json
import tempfile
from pathlib import Path

import git

from launcher.errors import LauncherError
from launcher.patching import gitops, overlay, series
from launcher.patching.lock import Target, find_target
from launcher.progress import quiet_stdout, say, step

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


def check(target: Target, patches: list[series.Patch], ref: str, url: str, as_json: bool = False) -> int:
    """Apply `patches` onto `ref` of `url` in a scratch clone, print the table, 1 on any conflict."""
    with quiet_stdout(as_json), tempfile.TemporaryDirectory(prefix="launcher-check-") as scratch:
        with step(f"cloning {url} into a scratch folder"):
            repo = gitops.clone(url, Path(scratch) / "trainer")
        base = gitops.fetch_commit(repo, ref)
        gitops.checkout_sparse(repo, base, "check", target.exclude)
        overlay.commit(repo, overlay.read_overlay(target.overlay))
        say(f"applying {len(patches)} patches of {target.name} onto {base[:12]}")
        rows = [_check_one(repo, patch) for patch in patches]
        repo.close()
    conflicts = [name for name, status, _ in rows if status == "conflict"]
    if as_json:
        print(json.dumps({"ok": not conflicts, "target": target.name, "base": base, "patches": [
            {"name": name, "result": status, "files": files.split(", ") if files else []}
            for name, status, files in rows]}, indent=2), flush=True)
        return 1 if conflicts else 0
    _print_table(rows)
    if conflicts:
        say(f"{len(conflicts)} of {len(rows)} patches conflict: {', '.join(conflicts)}")
        return 1
    say(f"all {len(rows)} patches apply")
    return 0


def _check_one(repo: git.Repo, patch: series.Patch) -> tuple[str, str, str]:
    """Apply one patch (3-way if needed) and commit it so the next patch sees it."""
    result = gitops.apply_patch(repo, patch.path, allow_3way=True)
    if result.status == "conflict":
        repo.git.reset("-q", "--hard", "HEAD")  # scratch clone: drop the failed attempt, try the next
        return patch.name, "conflict", ", ".join(result.files)
    info = series.read_message(patch.path)
    gitops.commit_as(repo, info.message, info.author, info.email, info.date)
    return patch.name, "clean" if result.status == "clean" else "needs 3-way", ""


def _print_table(rows: list[tuple[str, str, str]]) -> None:
    width = max([len("patch"), *(len(name) for name, _, _ in rows)])
    print(f"{'patch':<{width}} | result      | files", flush=True)
    print(f"{'-' * width}-|-------------|------", flush=True)
    for name, status, files in rows:
        print(f"{name:<{width}} | {status:<11} | {files}", flush=True)


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
    written = series.export_series(repo, target.commit, args.head, target.series, target.overlay)
    for patch in written:
        say(f"  wrote {patch.path}")
    say(f"{len(written)} patches in {target.series}; hashes in {series.HASH_FILE}")
    return 0
