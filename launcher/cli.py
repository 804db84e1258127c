"""`python -m launcher <command>`: the root only registers the command modules."""

import argparse
import sys
from pathlib import Path

from launcher import __version__
from launcher.commands import (
    comfy,
    doctor,
    flags,
    patches,
    plot,
    presets,
    rebase,
    report,
    run,
    sample,
    selftest,
    setup,
    verify,
    watchdog,
)
from launcher.errors import LauncherError
from launcher.patching.lock import DEFAULT_LOCK

COMMANDS = (setup, verify, patches, rebase, selftest, presets, run, flags, plot, sample, comfy, watchdog, doctor, report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher",
        description="QLoRA-train FLUX.2 [dev] on one 24 GB card with a patched ai-toolkit.",
    )
    parser.add_argument("--version", action="version", version=f"launcher {__version__}")
    parser.add_argument("--lock", type=Path, default=DEFAULT_LOCK, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except LauncherError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
