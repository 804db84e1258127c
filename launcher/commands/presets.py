"""`presets [PRESET]`: which shipped preset is for which card, and what each changes of the preset
it inherits; with PRESET, that preset in full, each value beside the file that set it.

Reads the YAML files only: no trainer, no workdir.
"""

import argparse
import json
from pathlib import Path

import yaml

from launcher.card_table import labels, read_cards, renamed, renamed_note
from launcher.progress import say
from launcher.runs.inheritance import INHERITS_KEY, Origins, leaves
from launcher.runs.presets import LAUNCHER_KEY, PRESETS_DIR, Preset, load_preset, read_preset
from launcher.runs.yaml_files import load_yaml

EXAMPLES = """examples:
  python -m launcher presets                 # each shipped preset: px, batch, card, what it changes
  python -m launcher presets 7900xtx_768     # one preset in full, each value beside the file that set it
  python -m launcher presets my_preset.yaml  # your own, laid over the presets it inherits
"""
IDENTITY = {"config.name", f"{LAUNCHER_KEY}.card"}
"""Keys every preset sets for itself: the listing shows them in their own columns, not as changes."""
PROCESS = "config.process[0]."


def register(subparsers) -> None:
    parser = subparsers.add_parser("presets", help="list the shipped presets, or show one in full with the file "
                                   "that set each value", epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", nargs="?", help="a shipped preset's name or a preset file: show it in full")
    parser.set_defaults(handler=run_presets)


def run_presets(args) -> int:
    for line in shown(args.preset) if args.preset else listing():
        say(line)
    return 0


def listing() -> list[str]:
    """Two lines a preset: name, px, batch, its cards (the card table's rows, else the preset's own
    `card`); then the preset it inherits and what it changes. A family stays together: each preset
    follows the one it inherits."""
    presets = sorted((load_preset(str(path)) for path in PRESETS_DIR.glob("*.yaml")),
                     key=lambda preset: [file.stem for file in reversed(preset.files)])
    cards = labels(read_cards())
    width = max(len(preset.path.stem) for preset in presets)
    lines = []
    for preset in presets:
        lines.append(f"{preset.path.stem:<{width}}  {pixels(preset):<6}  batch {batch(preset)}  "
                     f"{cards.get(preset.path.stem) or preset.settings['card'] or '-'}")
        if len(preset.files) > 1:
            changes = " ".join(f"{key.removeprefix(PROCESS)}={as_text(value)}"
                               for key, value in own_values(preset.path) if key not in IDENTITY)
            lines.append(f"{'':<{width}}  inherits {preset.files[1].stem}" + (f", sets {changes}" if changes else ""))
    return [*lines, "", "python -m launcher presets NAME shows one in full; docs/presets.md: a preset of your own"]


def pixels(preset: Preset) -> str:
    resolution = preset.config["config"]["process"][0]["datasets"][0].get("resolution", "?")
    return "/".join(str(px) for px in (resolution if isinstance(resolution, list) else [resolution])) + " px"


def batch(preset: Preset):
    return preset.config["config"]["process"][0]["train"].get("batch_size", 1)


def own_values(path: Path) -> list[tuple[str, object]]:
    """(key path, value) of every value the file itself sets, past its `inherits:`."""
    data = load_yaml(path)
    data.pop(INHERITS_KEY, None)
    return list(leaves(data))


def as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def shown(spec: str) -> list[str]:
    """The merged preset as YAML, each value followed by the file (and line) that set it."""
    preset = load_preset(spec)  # a preset with problems is refused here, each named with its file and line
    merged = read_preset(spec)
    text = yaml.safe_dump(merged.data, sort_keys=False, allow_unicode=True)
    chain = ", which inherits ".join(display(file) for file in preset.files)
    card = renamed(spec)
    note = [f"# {renamed_note(card)}"] if card else []
    return [*note, f"# {chain}", "# after each value: the file and line that set it", *annotated(text, merged.origins)]


def annotated(text: str, origins: Origins) -> list[str]:
    """`text`'s lines, each value on a line of its own followed by its origin (a value that spans
    lines, a long prompt, is left bare: a comment inside it would become part of it)."""
    lines = text.splitlines()
    width = min(max(map(len, lines)), 64)
    for number, path in one_line_values(yaml.compose(text, Loader=yaml.SafeLoader)).items():
        if path in origins:
            file, line = origins[path]
            lines[number] = f"{lines[number]:<{width}}  # {display(file)}:{line}"
    return lines


def one_line_values(node, path: str = "", found: dict | None = None) -> dict[int, str]:
    """{line index: key path} of the scalar values under `node` that start and end on one line."""
    found = {} if found is None else found
    items = [(f"{path}.{key.value}" if path else key.value, value) for key, value in node.value] \
        if isinstance(node, yaml.MappingNode) else [(f"{path}[{index}]", item) for index, item in enumerate(node.value)]
    for where, value in items:
        if isinstance(value, yaml.ScalarNode):
            if value.start_mark.line == value.end_mark.line:
                found[value.start_mark.line] = where
        else:
            one_line_values(value, where, found)
    return found


def display(file: Path) -> str:
    return file.name if file.parent == PRESETS_DIR else str(file)
