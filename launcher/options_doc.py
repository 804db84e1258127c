"""docs/options.md, generated from the settings catalogue (flux2_contract/settings.py):
`python -m launcher.options_doc` rewrites it, `--check` exits 1 where it differs."""

import argparse
import sys
from pathlib import Path

from flux2_contract import settings
from launcher.runs import launcher_settings
from launcher.writer import replace_own

DOC = Path(__file__).resolve().parents[1] / "docs" / "options.md"
INTRO = """# Options

Every setting the project owns, generated from `flux2_contract/settings.py` by
`python -m launcher.options_doc` (a test keeps this page equal to it). The trainer's own keys
(steps, lr, network, datasets...) are the trainer's, documented by ai-toolkit.

`auto` is turned into a value by `python -m launcher run` before the trainer starts (from the
self-test: `python -m launcher selftest`); the run's `config.yaml` holds every `model_kwargs`
setting below as a concrete value, and the trainer refuses an `auto` it is handed.
"""
BLOCKS = {"model": "## `model` (ai-toolkit's own keys under `config.process[]` that `run` resolves)",
          "model_kwargs": "## `model_kwargs` (under `config.process[].model`)",
          "launcher": "## `launcher:` (read by the launcher only)"}


def cell(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`".replace("|", "\\|")


def render() -> str:
    catalogue = {**settings.CATALOGUE, **launcher_settings.SETTINGS}
    parts = [INTRO]
    for block, title in BLOCKS.items():
        parts += ["", title, "", "| key | allowed | default | `auto` resolved by | what |", "| --- | --- | --- | --- | --- |"]
        for item in (item for item in catalogue.values() if item.block == block):
            allowed = item.allowed.replace("|", "\\|")
            resolver = item.auto or "(no `auto`)"
            marks = "written by `run` for each launch: " if item.written_by_run else ""
            marks += {True: "(a resume may change it) ", False: ""}.get(item.resume_may_change,
                                                                        f"(a resume may change it {item.resume_may_change}) ")
            parts.append(f"| `{item.name}` | {allowed} | {cell(item.default)} | {resolver} | {marks}{item.doc.replace('|', '/')} |")
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/options.md is not the generated page")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} differs from the catalogue: run python -m launcher.options_doc", file=sys.stderr)
            return 1
        return 0
    replace_own(DOC, text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
