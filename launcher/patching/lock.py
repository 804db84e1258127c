"""upstream.lock: which repositories are cloned, at which commit, with which series."""

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from launcher.errors import LauncherError
from launcher.suggest import did_you_mean

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LOCK = REPO_ROOT / "upstream.lock"
REQUIRED_KEYS = ("name", "url", "commit", "series")


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    commit: str
    series: Path  # absolute path of the series file
    exclude: list[str] = field(default_factory=list)
    requirements: str = "requirements.txt"
    overlay: Path | None = None  # absolute path of the folder of new trainer files, if any
    contract: Path | None = None  # absolute path of the contract package, committed with the overlay


def load_targets(lock_file: Path = DEFAULT_LOCK) -> list[Target]:
    """Parse and check the lock; paths in it are relative to the lock's folder."""
    try:
        data = yaml.safe_load(lock_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LauncherError(f"{lock_file} is missing; run the launcher from its repository") from None
    except yaml.YAMLError as error:
        raise LauncherError(f"{lock_file} is not valid YAML: {error}") from None
    entries = data.get("targets") if isinstance(data, dict) else None
    if not entries or not isinstance(entries, list):
        raise LauncherError(f"{lock_file} has no `targets:` list")
    targets = []
    for index, entry in enumerate(entries):
        missing = [key for key in REQUIRED_KEYS if not (isinstance(entry, dict) and entry.get(key))]
        if missing:
            raise LauncherError(f"{lock_file}: target #{index + 1} lacks {', '.join(missing)}")
        commit = str(entry["commit"])
        if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
            raise LauncherError(
                f"{lock_file}: target {entry['name']} has commit {commit!r}; write the full 40-hex hash"
            )
        targets.append(
            Target(
                name=entry["name"],
                url=entry["url"],
                commit=commit,
                series=lock_file.parent / entry["series"],
                exclude=list(entry.get("exclude") or []),
                requirements=entry.get("requirements", "requirements.txt"),
                overlay=lock_file.parent / entry["overlay"] if entry.get("overlay") else None,
                contract=lock_file.parent / entry["contract"] if entry.get("contract") else None,
            )
        )
    return targets


def find_target(name: str | None, lock_file: Path = DEFAULT_LOCK) -> Target:
    """The named target, or the first one when no name is given."""
    targets = load_targets(lock_file)
    if name is None:
        return targets[0]
    for target in targets:
        if target.name == name:
            return target
    known = [t.name for t in targets]
    raise LauncherError(f"unknown target {name!r} in {lock_file}; known: {', '.join(known)}{did_you_mean(name, known)}")
