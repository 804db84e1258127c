"""A field report: one zip a first owner of a card attaches to a bug report.

It holds what a maintainer asks for first, gathered without a question: `doctor`'s report
(versions, GPU, driver, memory, warnings), the stored self-test, the timings of a few steps of
the tiny model on this machine, the latest runs' metadata, plan, telemetry and last log lines,
and this launch's own errors. Every text is scrubbed on the way in: the workdir, the home
folder, the user and the host names become placeholders, in any letter case, as whole words and
path parts (`alice_smith` and `/home/alice-backup` lose the name too), in the text and in the names
of the zip's members, so the zip can be posted as it is.

A run folder is shared material: every file is read through launcher/user_files.py, following no
link below the folder that holds the runs (a link is left out, and the manifest says so), logs and
telemetry from their last bytes only, and every member is capped at MEMBER_BYTES. The zip itself is
created by the writer (launcher/writer.py): never over a file or through a link, never left half-written.
"""

import getpass
import json
import platform
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from launcher.nofollow import is_link
from launcher.runs.folders import RunFolder
from launcher.user_files import UserFileError, read_tail_lines

LOG_LINES = 300
TELEMETRY_ROWS = 500
MEMBER_BYTES = 1 * 2**20
"""The most bytes of one member of the zip: a report carries the end of a log, never a whole one."""
RUNS = 3
"""The most recent run folders the report carries."""


@dataclass
class Scrubber:
    """Replaces machine-specific names in text: longest first, so a workdir under the home folder
    becomes <workdir>, not <home>/..."""

    names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_machine(cls, workdir: Path) -> "Scrubber":
        names = {str(workdir.resolve()): "<workdir>", str(Path.home()): "<home>"}
        for value, placeholder in ((_user(), "<user>"), (platform.node(), "<host>")):
            if value and len(value) > 2:  # a one- or two-letter name would scrub words
                names[value] = placeholder
        return cls(names)

    def __post_init__(self) -> None:
        # every spelling of every name as a pattern, made once for all the members a report scrubs:
        # a whole word or path part (no letter or digit on either side; _ and - separate, as in alice_smith)
        self.patterns = [(re.compile(r"(?<![^\W_])" + re.escape(spelling) + r"(?![^\W_])", re.IGNORECASE),
                          self.names[name])
                         for name in sorted(self.names, key=len, reverse=True)
                         for spelling in sorted(spellings(name), key=len, reverse=True)]

    def __call__(self, text: str) -> str:
        for pattern, placeholder in self.patterns:
            text = pattern.sub(lambda _: placeholder, text)
        return text


def spellings(name: str) -> set[str]:
    """Every way a text the report carries may write `name`: as it is and with / for \\ (Windows
    paths are written both ways), as JSON writes it (backslashes doubled; `\\u00e9` for a letter
    outside ASCII, or the letter itself), and URL-encoded (a `file:` URL, a query)."""
    plain = {name, name.replace("\\", "/")}
    escaped = {json.dumps(form, ensure_ascii=ascii_only)[1:-1] for form in plain for ascii_only in (True, False)}
    encoded = {quote(form, safe=safe) for form in plain for safe in ("/:", "")}
    return plain | escaped | encoded


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's uid without a passwd entry)
        return ""


class Bundle:
    """The zip being written: every member's name and text pass through the scrubber, and are capped."""

    def __init__(self, handle, scrub: Scrubber) -> None:
        """`handle`: the writer's, so the zip is never over a file or through a link, and not left half-written."""
        self.scrub = scrub
        self.entries: list[str] = []
        self.left_out: list[str] = []
        self.zip = zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_DEFLATED)

    def add_text(self, name: str, text: str) -> None:
        name = self.scrub(name)
        data = self.scrub(text).encode("utf-8", errors="replace")
        if len(data) > MEMBER_BYTES:
            cut = f"[the first {len(data) - MEMBER_BYTES:,} bytes are left out]\n".encode()
            data = cut + data[-MEMBER_BYTES:]
        self.zip.writestr(name, data)
        self.entries.append(name)

    def add_json(self, name: str, data) -> None:
        self.add_text(name, json.dumps(data, indent=2, default=str) + "\n")

    def add_file(self, name: str, source: Path, within: Path, tail_lines: int | None = None) -> None:
        """A text file of the machine, its last bytes, or its last `tail_lines` lines; read without
        following a link below `within`. A missing one is skipped, one that cannot be read is named."""
        if not (source.exists() or is_link(source)):
            return
        try:
            text = read_tail_lines(source, tail_lines or 10**9, within)
        except UserFileError as error:
            self.left_out.append(f"{self.scrub(name)}: {self.scrub(error.reason)}")
            return
        self.add_text(name, text)

    def close(self) -> None:
        left_out = [f"left out: {line}" for line in self.left_out]
        self.zip.writestr("MANIFEST.txt", "\n".join(self.entries + left_out) + "\n")
        self.zip.close()


def _plain_file(path: Path) -> bool:
    return not is_link(path) and path.is_file()


def recent_runs(runs_dir: Path, count: int = RUNS) -> list[RunFolder]:
    """The run folders under `runs_dir` whose config was written last, newest first; no link is
    followed (a linked runs folder, run folder, config or job folder is passed over)."""
    if is_link(runs_dir) or not runs_dir.is_dir():
        return []
    found = sorted((p for p in runs_dir.glob("*") if _plain_file(p / "config.yaml") and not is_link(p)),
                   key=lambda p: (p / "config.yaml").lstat().st_mtime, reverse=True)
    runs = []
    for root in found[:count]:
        metadata = next((m for m in root.glob("*/run.json") if not is_link(m.parent)), None)
        runs.append(RunFolder(root, metadata.parent.name if metadata else root.name))
    return runs


def add_run(bundle: Bundle, run: RunFolder, label: str) -> None:
    """A run's metadata, config, the last lines of its log and telemetry, its watchdog events."""
    within = run.root.parent
    bundle.add_file(f"{label}/run.json", run.metadata, within)
    bundle.add_file(f"{label}/config.yaml", run.config, within)
    bundle.add_file(f"{label}/train.log.tail", run.log, within, LOG_LINES)
    bundle.add_file(f"{label}/telemetry.jsonl.tail", run.telemetry, within, TELEMETRY_ROWS)
    bundle.add_file(f"{label}/trainer-telemetry.jsonl.tail", run.trainer_telemetry, within, TELEMETRY_ROWS)
    bundle.add_file(f"{label}/watchdog.jsonl", run.watchdog_events, within)
