"""Which AMD GPU target a Windows machine needs, read from its display adapter names.

AMD's multi-arch torch wheels keep each GPU's kernels in a separate `amd-torch-device-gfxNNNN`
package, pulled in by a `[device-gfxNNNN]` extra; without the card's own target every kernel launch
fails with hipErrorInvalidImage. Windows names the card ("AMD Radeon RX 7900 XTX") but not its gfx
target: a card of the card table (presets/cards.csv) has its row's arch; the AMD cards the table does
not list are mapped by family here (TheRock RELEASES.md, "gfx target lookup table").
"""

import platform
import re
import subprocess

from launcher.card_table import read_cards
from launcher.errors import LauncherError

FAMILIES = {
    "gfx1100": "gfx110X", "gfx1101": "gfx110X", "gfx1102": "gfx110X",
    "gfx1200": "gfx120X", "gfx1201": "gfx120X",
}
TARGETS = tuple(FAMILIES)
DEFAULT_TARGET = "gfx1100"  # the RX 7900 XTX this project is first measured on
TARGET_CHOICES = ("auto", *TARGETS)

# (pattern over the adapter name, target) for cards the card table does not list; the first match wins
_CARDS = [
    (r"RX\s*79\d\d|PRO\s*W7[89]\d\d", "gfx1100"),  # RX 7900 XTX / XT / GRE, 7900M; PRO W7900 / W7800
    (r"RX\s*7[78]\d\d|PRO\s*W77\d\d", "gfx1101"),  # RX 7800 XT, 7700 XT / 7700; PRO W7700
    (r"RX\s*76\d\d|PRO\s*W7[56]\d\d", "gfx1102"),  # RX 7600 XT / 7600, 7600M; PRO W7600 / W7500
    (r"RX\s*907\d|AI\s*PRO\s*R9[67]\d\d", "gfx1201"),  # RX 9070 XT / 9070 / GRE; AI PRO R9700
    (r"RX\s*906\d", "gfx1200"),  # RX 9060 XT / 9060
]


def target_of(name: str) -> str | None:
    """The gfx target of one adapter name: the arch of the card table's longest card name in it (as
    whole words: "RX 7900 XT" is not in "RX 7900 XTX"), else its family's; None for another card."""
    listed = [card for card in read_cards() if card.hip
              and re.search(r"(?<!\w)" + re.escape(card.name) + r"(?!\w)", name, re.IGNORECASE)]
    if listed:
        return max(listed, key=lambda card: len(card.name)).arch
    for pattern, target in _CARDS:
        if re.search(pattern, name, re.IGNORECASE):
            return target
    return None


def pick_target(choice: str, names: list[str]) -> tuple[str, str]:
    """The target to install kernels for and the reason; `choice` is a target or "auto"."""
    known = {name: target_of(name) for name in names if target_of(name)}
    if choice != "auto":
        if known and choice not in known.values():
            cards = ", ".join(f"{name} is {target}" for name, target in known.items())
            raise LauncherError(f"--amd-arch {choice} matches no AMD card of this machine ({cards}): its kernels would "
                                f"fail with hipErrorInvalidImage; use --amd-arch {next(iter(known.values()))} or leave it auto")
        return choice, f"{FAMILIES[choice]}, set with --amd-arch"
    if known:
        name, target = next(iter(known.items()))
        others = [f"{other} ({t})" for other, t in known.items() if t != target]
        second = (f"; {', '.join(others)} gets no kernels (set --amd-arch to train on it instead)" if others else "")
        return target, f"{name} is {target} ({FAMILIES[target]}){second}"
    seen = ", ".join(names) if names else "no display adapter names"
    return DEFAULT_TARGET, (
        f"no RX 7000/9000 card recognised ({seen}): choosing {DEFAULT_TARGET} (RX 7900 XTX kernels); "
        "set --amd-arch to your card's target"
    )


def windows_adapter_names() -> list[str]:
    """Ask Windows for its display adapters (no extra package needed); empty elsewhere or on failure."""
    if platform.system() != "Windows":
        return []
    try:
        out = subprocess.run(
            ["powershell", "-NoProfile", "-Command", "(Get-CimInstance Win32_VideoController).Name"],
            capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
