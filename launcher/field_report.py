"""A field report: one zip a first owner of a card attaches to a bug report.

It holds what a maintainer asks for first, gathered without a question: `doctor`'s report
(versions, GPU, driver, memory, warnings), the stored self-test, the timings of a few steps of
the tiny model on this machine, the latest runs' metadata, plan, telemetry and last log lines,
and this launch's own errors. Every text is scrubbed on the way in: the workdir, the home
folder, the user and the host names become placeholders, so the zip can be posted as it is.
"""

import getpass
import json
import os
import platform
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from launcher.nofollow import create_new
from launcher.runs.folders import RunFolder

LOG_LINES = 300
TELEMETRY_ROWS = 500
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

    def __call__(self, text: str) -> str:
        for name in sorted(self.names, key=len, reverse=True):
            text = re.sub(r"(?<![\w-])" + re.escape(name) + r"(?![\w-])", self.names[name].replace("\\", "\\\\"), text)
            if os.sep == "\\":
                text = text.replace(name.replace("\\", "/"), self.names[name])
        return text


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's uid without a passwd entry)
        return ""


class Bundle:
    """The zip being written: every entry passes through the scrubber."""

    def __init__(self, path: Path, scrub: Scrubber) -> None:
        self.path = path
        self.scrub = scrub
        self.entries: list[str] = []
        self.handle = create_new(path.parent, path)  # never over a file or through a link
        self.zip = zipfile.ZipFile(self.handle, "w", compression=zipfile.ZIP_DEFLATED)

    def add_text(self, name: str, text: str) -> None:
        self.zip.writestr(name, self.scrub(text))
        self.entries.append(name)

    def add_json(self, name: str, data) -> None:
        self.add_text(name, json.dumps(data, indent=2, default=str) + "\n")

    def add_file(self, name: str, source: Path, tail_lines: int | None = None) -> None:
        """A text file of the machine, or its last `tail_lines` lines; a missing one is skipped."""
        if not source.is_file() or source.is_symlink():
            return
        text = source.read_text(encoding="utf-8", errors="replace")
        if tail_lines is not None:
            text = "".join(text.splitlines(keepends=True)[-tail_lines:])
        self.add_text(name, text)

    def close(self) -> None:
        self.zip.writestr("MANIFEST.txt", "\n".join(self.entries) + "\n")
        self.zip.close()
        self.handle.close()


def recent_runs(runs_dir: Path, count: int = RUNS) -> list[RunFolder]:
    """The run folders under `runs_dir` whose config was written last, newest first."""
    if not runs_dir.is_dir():
        return []
    found = sorted((p for p in runs_dir.glob("*") if (p / "config.yaml").is_file() and not p.is_symlink()),
                   key=lambda p: (p / "config.yaml").stat().st_mtime, reverse=True)
    runs = []
    for root in found[:count]:
        metadata = next(root.glob("*/run.json"), None)
        runs.append(RunFolder(root, metadata.parent.name if metadata else root.name))
    return runs


def add_run(bundle: Bundle, run: RunFolder, label: str) -> None:
    """A run's metadata, config, the last lines of its log and telemetry, its watchdog events."""
    bundle.add_file(f"{label}/run.json", run.metadata)
    bundle.add_file(f"{label}/config.yaml", run.config)
    bundle.add_file(f"{label}/train.log.tail", run.log, LOG_LINES)
    bundle.add_file(f"{label}/telemetry.jsonl.tail", run.telemetry, TELEMETRY_ROWS)
    bundle.add_file(f"{label}/trainer-telemetry.jsonl.tail", run.trainer_telemetry, TELEMETRY_ROWS)
    bundle.add_file(f"{label}/watchdog.jsonl", run.watchdog_events)
