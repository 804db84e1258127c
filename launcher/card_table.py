"""The card table, `presets/cards.csv`: one row a card the project is for, the only place a card is named.

A row gives the card's name, its arch as the compilers spell it (`gfx1201`, `sm_89`), its memory
as sold, the shipped preset for it, and what the self-test's rules make its preset train on:
the candidate with Triton, the candidate without it, and the stream mode. Everything else is
derived from the rows: each card preset's `launcher: card:` label, docs/cards.md's card and preset
tables (`python -m launcher.cards_doc` writes them) and the self-test's verdicts on paper
(`launcher/selftest/cards.py`, which checks the last three columns). Whether a card has FP8
matrix units is not a column: it is the runtime's rule (`qtypes.arch_has_fp8_units` in the
overlay) applied to the arch. Adding a card is one row, then `python -m launcher.cards_doc`.
"""

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from launcher import trainer_rules
from launcher.errors import LauncherError
from launcher.runs.presets import PRESETS_DIR

TABLE = PRESETS_DIR / "cards.csv"
COLUMNS = ("card", "arch", "vram_gb", "preset", "with_triton", "without_triton", "stream_mode")
STREAM_MODES = ("serialized", "overlapped")
ARCH = re.compile(r"(sm_\d+[a-z]?|gfx[0-9a-f]+)")
"""NVIDIA's `sm_<major><minor>` with an optional feature suffix (`sm_90a`), or AMD's `gfx<id>`."""


@dataclass(frozen=True)
class Card:
    name: str
    arch: str
    vram_gib: int
    """The card's memory as sold (24 for a 24 GB card): what the memory plan is run against on paper."""
    preset: str
    """The shipped preset for the card's memory, without `.yaml`."""
    with_triton: str = ""
    without_triton: str = ""
    stream_mode: str = ""
    """What the preset trains on by the self-test's rules: the candidate with and without Triton, the stream mode."""

    @property
    def hip(self) -> bool:
        return self.arch.startswith("gfx")

    @property
    def fp8_units(self) -> bool:
        """FP8 matrix units: the runtime's own rule, so the paper verdict and the card agree."""
        return trainer_rules.qtypes().arch_has_fp8_units(self.arch)


def read_cards(path: Path = TABLE) -> list[Card]:
    """The rows of the card table in `path`, checked: a bad row is refused with its line and the fix."""
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if tuple(header or ()) != COLUMNS:
            raise LauncherError(f"{path}, line 1: the header must be {','.join(COLUMNS)}, not {','.join(header or [])!r}")
        return [_card(path, reader.line_num, row) for row in reader if any(cell.strip() for cell in row)]


def _card(path: Path, line: int, row: list[str]) -> Card:
    where = f"{path}, line {line}"
    if len(row) != len(COLUMNS):
        raise LauncherError(f"{where}: {len(row)} cells, the table has {len(COLUMNS)} ({','.join(COLUMNS)})")
    name, arch, vram, preset, with_triton, without_triton, mode = (cell.strip() for cell in row)
    if not ARCH.fullmatch(arch):
        raise LauncherError(f"{where}: arch {arch!r} is neither sm_<number> (NVIDIA) nor gfx<id> (AMD); "
                            "write it as the compilers spell it, e.g. sm_89 or gfx1201")
    if not vram.isdigit():
        raise LauncherError(f"{where}: vram_gb {vram!r} is not a whole number of GB; write the memory as sold, e.g. 16")
    if not (PRESETS_DIR / f"{preset}.yaml").is_file():
        raise LauncherError(f"{where}: preset {preset!r} is not a file of {PRESETS_DIR.name}/; name a shipped preset "
                            "without .yaml, e.g. rtx16gb_512")
    if mode not in STREAM_MODES:
        raise LauncherError(f"{where}: stream_mode {mode!r} is none of {', '.join(STREAM_MODES)}")
    return Card(name, arch, int(vram), preset, with_triton, without_triton, mode)


def labels(cards: list[Card]) -> dict[str, str]:
    """{preset: its `launcher: card:` label}: the names of its cards in table order, then their memory."""
    grouped: dict[str, list[Card]] = {}
    for card in cards:
        grouped.setdefault(card.preset, []).append(card)
    result = {}
    for preset, members in grouped.items():
        sizes = sorted({card.vram_gib for card in members}, reverse=True)
        result[preset] = f"{', '.join(card.name for card in members)} ({' or '.join(map(str, sizes))} GB)"
    return result
