"""A series tried on an upstream commit: applied in a scratch clone, each patch's result reported
(clean, needs 3-way, conflict and its files), as a table or one JSON object. Nothing of the
user's checkout is touched."""

import json
import tempfile
from pathlib import Path

import git

from launcher.patching import gitops, overlay, series
from launcher.patching.lock import Target
from launcher.progress import quiet_stdout, say, step


def check(target: Target, patches: list[series.Patch], ref: str, url: str, as_json: bool = False) -> int:
    """Apply `patches` onto `ref` of `url` in a scratch clone, print the table, 1 on any conflict."""
    with quiet_stdout(as_json), tempfile.TemporaryDirectory(prefix="launcher-check-") as scratch:
        with step(f"cloning {url} into a scratch folder"):
            repo = gitops.clone(url, Path(scratch) / "trainer")
        base = gitops.fetch_commit(repo, ref)
        gitops.checkout_sparse(repo, base, "check", target.exclude)
        overlay.commit(repo, overlay.trainer_files(target))
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
