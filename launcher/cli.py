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
    ui,
    verify,
    watchdog,
)
from launcher.errors import LauncherError, os_error_line, unexpected_error_line
from launcher.patching.lock import DEFAULT_LOCK
from launcher.progress import utf8_output

COMMANDS = (setup, verify, patches, rebase, selftest, presets, run, flags, plot, sample, comfy, watchdog, doctor, report, ui)


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
    """The entry point and the one error boundary: whatever reaches it becomes one `error:` line."""
    utf8_output()
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except LauncherError as error:
        return fail(str(error))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    except OSError as error:
        return fail(os_error_line(error))
    except RecursionError:
        return fail("a file nests too deeply to read (a JSON or YAML file of thousands of levels): "
                    "check the files the command names")
    except MemoryError:
        return fail("out of host memory: a file may be far larger than it should be, or other programs "
                    "hold the memory; close them or check the files the command names")
    except UnicodeError as error:
        return fail(f"a text is not valid {getattr(error, 'encoding', 'UTF-8')}: {error}; save the file as UTF-8")
    except Exception as error:  # noqa: BLE001 - the boundary: a bug gets a line too, never a bare traceback
        return fail(unexpected_error_line(error))


def fail(line: str) -> int:
    print(f"error: {line}", file=sys.stderr, flush=True)
    return 2
