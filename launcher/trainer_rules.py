"""The trainer's stdlib-only rules, imported in-process: the one bridge from the launcher to them.

The settings catalogue, the qtype table, the memory plan, the quantized-cache index and the
safetensors header reader live in the overlay (`overlay/toolkit/`), which setup copies into the
trainer; the launcher imports the same files, so both sides apply one rule and `run --dry-run`
needs no trainer venv. What needs torch runs in the trainer's venv (`launcher/in_trainer/`).
Importing this module needs nothing beyond the standard library and PyYAML (the lock file): the
benchmarks import it on machines without GitPython.
"""

import hashlib
import importlib
import importlib.machinery
import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from launcher.patching.lock import find_target


def import_module(folder: Path, name: str) -> ModuleType:
    """`toolkit/<name>.py` of the overlay folder `folder`, imported under the launcher's interpreter.
    The overlay's `toolkit` folder is imported as a package of its own name, one per folder, so the
    modules' relative imports resolve inside it and nothing named `toolkit` enters the launcher's
    namespace."""
    toolkit = Path(folder) / "toolkit"
    package = "flux2_overlay_" + hashlib.sha256(str(toolkit.resolve()).encode()).hexdigest()[:12]
    if package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [str(toolkit)]
        sys.modules[package] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{package}.{name}")


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
