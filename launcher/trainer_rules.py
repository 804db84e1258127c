"""The trainer's stdlib-only rules, imported in-process: the one bridge from the launcher to them.

The settings catalogue, the qtype table, the memory plan, the quantized-cache index and the
safetensors header reader live in the overlay (`overlay/toolkit/`), which setup copies into the
trainer; the launcher imports the same files, so both sides apply one rule and `run --dry-run`
needs no trainer venv. What needs torch runs in the trainer's venv (`launcher/in_trainer/`).
"""

from functools import cache
from types import ModuleType

from launcher.patching.lock import find_target
from launcher.patching.overlay import import_module


@cache
def overlay(name: str) -> ModuleType:
    """The overlay's `toolkit/<name>.py` (stdlib-only modules only)."""
    return import_module(find_target(None).overlay, name)


def settings() -> ModuleType:
    return overlay("settings")


def qtypes() -> ModuleType:
    return overlay("qtypes")


def memory_plan() -> ModuleType:
    return overlay("memory_plan")
