"""A channel's requirement overrides: the trainer's requirements file as pip gets it, with some pins
replaced, written into the workdir (the fork's own files are never edited).

A channel overrides a pin where its torch cannot install or run beside the fork's: torch 2.13
requires setuptools>=77.0.3, which the fork's `setuptools==69.5.1` makes unresolvable. The copy
inlines every `-r` include (each one adjusted too) and makes `-c` paths absolute, so pip reads the
same lines from another folder; a package the files do not name is appended.
"""

import re
from pathlib import Path

from launcher.writer import replace_own

NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
INCLUDE = ("-r", "--requirement")
CONSTRAINT = ("-c", "--constraint")


def normalized(name: str) -> str:
    """PEP 503's normalized project name: `Optimum_Quanto` and `optimum-quanto` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def named_package(line: str) -> str | None:
    """The package a requirement line names (`pkg==1`, `pkg[extra]>=1`, `pkg @ url`), else None
    (options, URLs, paths, comments)."""
    text = line.split("#", 1)[0].strip()
    if not text or text.startswith("-") or "://" in text.split("@", 1)[0] or text.startswith((".", "/")):
        return None
    match = NAME.match(text)
    return normalized(match.group(1)) if match else None


def adjusted_lines(requirements: Path, overrides: dict[str, str], seen: set[str], done: set[Path]) -> list[str]:
    """The lines of `requirements` and its `-r` includes, each override's package pinned to its version."""
    wanted = {normalized(name): f"{name}=={version}" for name, version in overrides.items()}
    lines = [f"# from {requirements.name}\n"]
    for line in requirements.read_text(encoding="utf-8").splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) == 2 and parts[0] in INCLUDE:
            included = (requirements.parent / parts[1]).resolve()
            if included not in done:
                done.add(included)
                lines += adjusted_lines(included, overrides, seen, done)
            continue
        if len(parts) == 2 and parts[0] in CONSTRAINT:
            lines.append(f"{parts[0]} {(requirements.parent / parts[1]).resolve()}\n")
            continue
        package = named_package(line)
        if package in wanted:
            seen.add(package)
            lines.append(f"{wanted[package]}  # the torch channel's override of: {line.strip()}\n")
        else:
            lines.append(line + "\n")
    return lines


def write_adjusted(requirements: Path, overrides: dict[str, str], out: Path) -> Path:
    """Write `requirements` with `overrides` applied to `out`; returns `out`."""
    seen: set[str] = set()
    lines = adjusted_lines(requirements, overrides, seen, {requirements.resolve()})
    added = [f"{name}=={version}  # the torch channel's override (not in the trainer's requirements)\n"
             for name, version in sorted(overrides.items()) if normalized(name) not in seen]
    header = f"# written by `python -m launcher setup`: {requirements} with the torch channel's overrides\n"
    replace_own(out, header + "".join(lines + added))
    return out


def plan_line(overrides: dict[str, str]) -> str | None:
    """For `setup --dry-run`: the pins that replace the trainer's own, or None."""
    if not overrides:
        return None
    pins = ", ".join(f"{name}=={version}" for name, version in sorted(overrides.items()))
    return f"requirement overrides: {pins} (in a copy of the trainer's requirements written to the workdir)"
