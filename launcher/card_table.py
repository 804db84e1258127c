"""The card table, `presets/cards.csv`: one row a card the project is for, the only place a card is named.

A row gives the card's name, its arch as the compilers spell it (`gfx1201`, `sm_89`), its memory
as sold, the shipped preset for it, and the name that card's preset had before presets that only
renamed another were merged into it (`old_name`: that name still runs the preset, in its old run
folder). Everything else is derived from the rows: the cards `python -m launcher presets` shows
for each preset, docs/cards.md's card and preset tables (`python -m launcher.cards_doc` writes them)
and the self-test's verdicts on paper (`launcher/selftest/cards.py`). Whether a card has FP8
matrix units is not a column: it is the runtime's rule (`qtypes.arch_has_fp8_units` in the
overlay) applied to the arch. Adding a card is one row, then `python -m launcher.cards_doc`.
"""

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from flux2_contract import qtypes
from launcher.errors import LauncherError
from launcher.runs.presets import PRESETS_DIR

TABLE = PRESETS_DIR / "cards.csv"
COLUMNS = ("card", "arch", "vram_gb", "preset", "old_name")
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
    old_name: str = ""
    """The name the card's preset had before it was merged into `preset`, or empty: that name still runs `preset`."""
    line: int = 0
    """The card's line in the table."""

    @property
    def hip(self) -> bool:
        return self.arch.startswith("gfx")

    @property
    def fp8_units(self) -> bool:
        """FP8 matrix units: the runtime's own rule, so the paper verdict and the card agree."""
        return qtypes.arch_has_fp8_units(self.arch)


def read_cards(path: Path = TABLE) -> list[Card]:
    """The rows of the card table in `path`, checked: a bad row is refused with its line and the fix."""
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if tuple(header or ()) != COLUMNS:
            raise LauncherError(f"{path}, line 1: the header must be {','.join(COLUMNS)}, not {','.join(header or [])!r}")
        cards = [_card(path, reader.line_num, row) for row in reader if any(cell.strip() for cell in row)]
    old_names(cards, path)
    return cards


def _card(path: Path, line: int, row: list[str]) -> Card:
    where = f"{path}, line {line}"
    if len(row) != len(COLUMNS):
        raise LauncherError(f"{where}: {len(row)} cells, the table has {len(COLUMNS)} ({','.join(COLUMNS)})")
    name, arch, vram, preset, old_name = (cell.strip() for cell in row)
    if not ARCH.fullmatch(arch):
        raise LauncherError(f"{where}: arch {arch!r} is neither sm_<number> (NVIDIA) nor gfx<id> (AMD); "
                            "write it as the compilers spell it, e.g. sm_89 or gfx1201")
    if not vram.isdigit():
        raise LauncherError(f"{where}: vram_gb {vram!r} is not a whole number of GB; write the memory as sold, e.g. 16")
    if not (PRESETS_DIR / f"{preset}.yaml").is_file():
        raise LauncherError(f"{where}: preset {preset!r} is not a file of {PRESETS_DIR.name}/; name a shipped preset "
                            "without .yaml, e.g. base_512")
    if old_name and (PRESETS_DIR / f"{old_name}.yaml").is_file():
        raise LauncherError(f"{where}: old_name {old_name!r} is a shipped preset's file; an old name is one no file "
                            "has any more, or leave the cell empty")
    return Card(name, arch, int(vram), preset, old_name, line)


def old_names(cards: list[Card], path: Path = TABLE) -> dict[str, Card]:
    """{a merged preset's old name: the first row naming it}; refused where the rows send one name to two presets."""
    found: dict[str, Card] = {}
    for card in cards:
        first = found.setdefault(card.old_name, card) if card.old_name else card
        if first.preset != card.preset:
            raise LauncherError(f"{path}, line {card.line}: old_name {card.old_name!r} is preset {first.preset} on line "
                                f"{first.line}, {card.preset} here; give an old name one preset")
    return found


def renamed(spec: str, cards: list[Card] | None = None) -> Card | None:
    """The row whose `old_name` `spec` names (`rtx4090_512`, `rtx4090_512.yaml`, `presets/rtx4090_512.yaml`), or
    None: a file that exists is never an old name."""
    path = Path(spec)
    if path.suffix not in ("", ".yaml") or path.is_file() or path.parent.resolve() not in (Path.cwd().resolve(), PRESETS_DIR):
        return None
    return old_names(read_cards() if cards is None else cards).get(path.name.removesuffix(".yaml"))


def renamed_note(card: Card) -> str:
    """What `run` and `presets` say when a preset is named by its old name."""
    members = ", ".join(row.name for row in read_cards() if row.old_name == card.old_name)
    return (f"{card.old_name} is {card.preset} now ({TABLE.parent.name}/{TABLE.name}: {members}); it trains in the run "
            f"folder flux2_{card.old_name} as before")


def labels(cards: list[Card]) -> dict[str, str]:
    """{preset: the cards it is for}: the names of its rows in table order, then their memory."""
    grouped: dict[str, list[Card]] = {}
    for card in cards:
        grouped.setdefault(card.preset, []).append(card)
    result = {}
    for preset, members in grouped.items():
        sizes = sorted({card.vram_gib for card in members}, reverse=True)
        result[preset] = f"{', '.join(card.name for card in members)} ({' or '.join(map(str, sizes))} GB)"
    return result
