"""Every command's `--help` ends in worked examples of that very command (design.md, CHANGELOG)."""

import argparse
from pathlib import Path

import pytest

from launcher.cli import build_parser


def commands(parser: argparse.ArgumentParser, prefix: tuple = ()) -> list[tuple[tuple, argparse.ArgumentParser]]:
    """(command words, its parser) for every command the root registers; verbs of a command that
    has its own examples (patches check/export) are listed too."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((prefix + (name,), sub))
                found += commands(sub, prefix + (name,))
    return found


# every command; a verb only where it has examples of its own (the others: its command's help has them)
CASES = [(words, parser) for words, parser in commands(build_parser()) if len(words) == 1 or parser.epilog]


@pytest.mark.parametrize("words, parser", CASES, ids=[" ".join(words) for words, _ in CASES])
def test_help_has_an_example_of_the_command(words, parser):
    text = parser.format_help()
    assert "examples:" in text, f"`python -m launcher {' '.join(words)} --help` has no examples"
    assert f"python -m launcher {words[0]}" in text.split("examples:", 1)[1]


COMMANDS_DOC = Path(__file__).resolve().parent.parent / "docs" / "commands.md"
HEADINGS = [line for line in COMMANDS_DOC.read_text(encoding="utf-8").splitlines() if line.startswith("## ")]


@pytest.mark.parametrize("words", [words for words, _ in CASES if len(words) == 1], ids=lambda words: words[0])
def test_docs_commands_has_a_section_for_the_command(words):
    assert any(f"`{words[0]}`" in heading or f"`{words[0]} " in heading for heading in HEADINGS), \
        f"docs/commands.md has no section for `{words[0]}`"
