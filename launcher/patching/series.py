"""A patch series: the `series` order file, the patch files, their recorded hashes.

The series file lists patch names, one a line, relative to its folder; `#` starts a
comment. `series.sha256` beside it records each file's sha256, so an edited patch is
caught before it is applied.
"""

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from launcher.errors import LauncherError
from launcher.patching import overlay
from launcher.patching.gitops import GIT_ENV
from launcher.writer import replace_own

HASH_FILE = "series.sha256"
SERIES_HEADER = "# Applied in this order by `python -m launcher setup`, after the overlay; see WALLS.md.\n"

# Options that make `git format-patch` output depend only on the commits: no commit
# hashes, no git version signature, no abbreviations that grow with the repository,
# no "n/m" numbering that changes when a patch is added.
EXPORT_OPTIONS = (
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-numbered",
    "--no-stat",
    "--subject-prefix=PATCH",
    "--no-cover-letter",
    "--no-thread",
    "--encode-email-headers",
)


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path

    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class PatchMessage:
    author: str
    email: str
    date: str
    message: str  # subject, blank line, body: the commit message


def read_series(series_file: Path) -> list[Patch]:
    """The patches in order; every listed file must exist and every patch file be listed."""
    if not series_file.is_file():
        raise LauncherError(f"series file {series_file} is missing; create it (it may be empty)")
    folder = series_file.parent
    names = []
    for number, raw in enumerate(series_file.read_text(encoding="utf-8").splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if not (folder / name).is_file():
            raise LauncherError(
                f"{series_file}:{number} names {name}, which is not in {folder}; restore the "
                "file or remove the line"
            )
        names.append(name)
    unlisted = sorted(p.name for p in folder.glob("*.patch") if p.name not in names)
    if unlisted:
        raise LauncherError(
            f"{folder} holds patches that {series_file.name} does not list: {', '.join(unlisted)}. "
            "Add each to the series in its place, or delete it."
        )
    return [Patch(name, folder / name) for name in names]


def read_recorded_hashes(series_file: Path) -> dict[str, str]:
    hash_file = series_file.parent / HASH_FILE
    if not hash_file.is_file():
        return {}
    recorded = {}
    for line in hash_file.read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            recorded[name.strip()] = digest
    return recorded


def check_hashes(series_file: Path, patches: list[Patch]) -> None:
    """Refuse patches whose content differs from what series.sha256 records."""
    recorded = read_recorded_hashes(series_file)
    changed = [p.name for p in patches if recorded.get(p.name) != p.sha256()]
    if changed:
        raise LauncherError(
            f"patch files differ from {series_file.parent / HASH_FILE}: {', '.join(changed)}. "
            "If the edit is deliberate, regenerate the series with `python -m launcher patches "
            "export`; otherwise restore the files (git checkout -- patches/)."
        )


def write_hashes(series_file: Path, patches: list[Patch]) -> None:
    lines = [f"{p.sha256()}  {p.name}\n" for p in patches]
    replace_own(series_file.parent / HASH_FILE, "".join(lines))


def load_checked(series_file: Path) -> list[Patch]:
    """Read the series and check its hashes: what every command that applies patches uses."""
    patches = read_series(series_file)
    check_hashes(series_file, patches)
    return patches


def read_message(patch: Path) -> PatchMessage:
    """Author, date and commit message of a `git format-patch` file, parsed by `git mailinfo`."""
    with tempfile.TemporaryDirectory() as scratch:
        msg, body = Path(scratch) / "msg", Path(scratch) / "patch"
        with patch.open("rb") as stream:
            header = git.cmd.Git().execute(
                ["git", "mailinfo", "-b", "-u", str(msg), str(body)],
                istream=stream,
                env={**os.environ, **GIT_ENV},
            )
        fields = dict(line.split(": ", 1) for line in header.splitlines() if ": " in line)
        if not fields.get("Author") or not fields.get("Subject"):
            raise LauncherError(
                f"{patch} is not a `git format-patch` file (no From:/Subject: header); "
                "export it with `python -m launcher patches export`"
            )
        text = msg.read_text(encoding="utf-8").strip("\n")
    message = fields["Subject"] + ("\n\n" + text if text else "") + "\n"
    return PatchMessage(fields["Author"], fields.get("Email", ""), fields.get("Date", ""), message)


def export_series(repo: git.Repo, base: str, head: str, series_file: Path,
                  overlay_dir: Path | None = None, contract_dir: Path | None = None) -> list[Patch]:
    """Write base..head as patch files, the series file and the hashes; drop stale patches.

    With an overlay folder, files that head adds to base go there instead of into patches
    (one copy for every target; the contract package's into `contract_dir`), and the overlay commit
    itself is not exported. Only the
    folder's *.patch files, `series` and `series.sha256` are rewritten; the series' comment
    lines are kept.
    """
    folder = series_file.parent
    folder.mkdir(parents=True, exist_ok=True)
    comments = _comments(series_file)
    start, _ = overlay.split_history(repo, base, head)
    excluded = []
    if overlay_dir is not None:
        overlay.export(repo, base, head, overlay_dir, contract_dir)
        excluded = [f":(exclude){name}" for name in overlay.new_files(repo, base, head)]
    with tempfile.TemporaryDirectory() as scratch:
        repo.git.format_patch(*EXPORT_OPTIONS, "-o", scratch, f"{start}..{head}", "--", ".", *excluded)
        produced = sorted(Path(scratch).glob("*.patch"))
        for old in folder.glob("*.patch"):
            old.unlink()
        for new in produced:
            replace_own(folder / new.name, new.read_bytes())
    names = [p.name for p in produced]
    replace_own(series_file, SERIES_HEADER + "".join(f"{name}\n" for name in names) + "".join(comments))
    patches = [Patch(name, folder / name) for name in names]
    write_hashes(series_file, patches)
    return patches


def _comments(series_file: Path) -> list[str]:
    """The series' own comment lines (notes on dropped or unported patches), header aside."""
    if not series_file.is_file():
        return []
    lines = series_file.read_text(encoding="utf-8").splitlines(keepends=True)
    return [line for line in lines if line.lstrip().startswith("#") and not line.startswith("# Applied in this order")]
