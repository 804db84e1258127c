"""`inherits:`: a preset written as another preset plus what differs.

    inherits: 7900xtx_512        # a shipped preset's name, or a YAML file relative to this file's folder
    config:
      name: flux2_7900xtx_768    # everything else as in 7900xtx_512

The parent is read first (itself inheriting, to any depth) and the file laid over it:

- mappings merge key by key, all the way down;
- a list of mappings (`config.process`, a process's `datasets`) merges item by item, by index,
  so `datasets: [{resolution: [768]}]` changes the resolution and keeps the caption settings;
  items beyond the shorter list are kept as they are;
- any other value (a number, a text, a list such as `resolution: [512]` or `prompts`) replaces
  the parent's.

Nothing inherited can be deleted, only set to another value. The key path of every value keeps
the file and line that set it, so a schema problem names the file to edit.
"""

from dataclasses import dataclass
from pathlib import Path

from launcher.errors import LauncherError
from launcher.runs.schema import kind_of, short
from launcher.runs.yaml_files import load_yaml_lines

INHERITS_KEY = "inherits"
PRESET_SUFFIXES = (".yaml", ".yml")
Origins = dict[str, tuple[Path, int]]
"""{key path as the schema writes it (`config.process[0].train.lr`): (the file that set it, its line)}"""


@dataclass(frozen=True)
class MergedPreset:
    data: object
    """The preset with its parents laid under it, without `inherits`."""
    origins: Origins
    files: tuple[Path, ...]
    """The preset's file first, then its parent, up to the file that inherits nothing."""


def shipped_names(folder: Path) -> list[str]:
    return sorted(path.stem for path in folder.glob("*.yaml"))


def read_merged(path: Path, shipped: Path, moved: dict[str, Path] | None = None) -> MergedPreset:
    """The preset in `path` laid over the chain of presets it inherits; `shipped` holds the
    presets a bare name refers to, `moved` the files of shipped presets' old names."""
    layers: list[tuple[Path, object, Origins]] = []  # the preset first, then each parent
    file = path
    while True:
        data, lines = _load(file, layers[-1][0] if layers else None)
        origins = {key: (file, line) for key, line in lines.items()}
        if layers and not isinstance(data, dict):
            raise LauncherError(f"{layers[-1][0]} inherits {file}, which holds {kind_of(data)}, not a preset's "
                                f"mapping of settings: inherit a preset")
        layers.append((file, data, origins))
        if not isinstance(data, dict) or INHERITS_KEY not in data:
            break
        spec, line = data.pop(INHERITS_KEY), lines.get(INHERITS_KEY)
        origins.pop(INHERITS_KEY, None)
        parent = _parent_file(spec, file, line, shipped, moved or {})
        if parent.resolve() in {layer[0].resolve() for layer in layers}:
            circle = " -> ".join(str(layer[0]) for layer in layers) + f" -> {parent}"
            raise LauncherError(f"{path} inherits in a circle: {circle}; remove the `{INHERITS_KEY}:` line of "
                                "one of them")
        file = parent
    _, merged, merged_origins = layers[-1]
    for _, data, origins in reversed(layers[:-1]):
        replaced: list[str] = []
        merged = merge(merged, data, "", replaced)
        merged_origins = {key: origin for key, origin in merged_origins.items()
                          if not any(_under(key, where) for where in replaced)} | origins
    return MergedPreset(merged, merged_origins, tuple(layer[0] for layer in layers))


def _load(path: Path, child: Path | None) -> tuple[object, dict[str, int]]:
    """A file of the chain; a parent's problem also names the file that inherits it."""
    try:
        return load_yaml_lines(path)
    except LauncherError as error:
        if child is None:
            raise
        raise LauncherError(f"{error} (inherited by {child})") from None


def _parent_file(spec, child: Path, line: int | None, shipped: Path, moved: dict[str, Path]) -> Path:
    """The file `inherits: spec` in `child` names: relative to `child`'s folder first, then a shipped
    preset, then a shipped preset's old name."""
    where = f"{child}{f', line {line}' if line else ''}: {INHERITS_KEY}"
    if not isinstance(spec, str) or not spec.strip():
        raise LauncherError(f"{where} = {short(spec)}: not a preset; write a shipped preset's name "
                            f"({', '.join(shipped_names(shipped))}) or a YAML file's path relative to {child.parent}")
    for candidate in (child.parent / spec, child.parent / f"{spec}.yaml", shipped / spec, shipped / f"{spec}.yaml"):
        if _is_file(candidate) and candidate.suffix.lower() in PRESET_SUFFIXES:
            return candidate
        if _is_file(candidate):  # any other file may hold anything, secrets too: never read as a preset
            raise LauncherError(f"{where} = {short(spec)}: not a preset file (a preset ends in .yaml); inherit a "
                                "shipped preset's name or a .yaml file")
    if spec.removesuffix(".yaml") in moved:
        return moved[spec.removesuffix(".yaml")]
    raise LauncherError(f"{where} = {short(spec)}: no such preset, neither a file relative to {child.parent} nor a "
                        f"shipped preset ({', '.join(shipped_names(shipped))}); fix the name or the path")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the filesystem
        return False


def merge(parent, child, path: str, replaced: list[str]):
    """`child` laid over `parent` (see the module's rules); the key paths where a child's value
    replaced the parent's whole are appended to `replaced`."""
    if isinstance(parent, dict) and isinstance(child, dict):
        merged = dict(parent)
        for key, value in child.items():
            where = f"{path}.{key}" if path else str(key)
            merged[key] = merge(parent[key], value, where, replaced) if key in parent else value
        return merged
    if _mappings(parent) and _mappings(child):
        merged = [merge(old, new, f"{path}[{index}]", replaced) for index, (old, new) in enumerate(zip(parent, child))]
        return merged + parent[len(child):] + child[len(parent):]
    replaced.append(path)
    return child


def leaves(node, path: str = ""):
    """(key path, value) of each value a preset sets under `node`, as it merges: mappings key by key,
    a list of mappings item by item, anything else whole."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, f"{path}.{key}" if path else str(key))
    elif _mappings(node):
        for index, item in enumerate(node):
            yield from leaves(item, f"{path}[{index}]")
    else:
        yield path, node


def _mappings(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)


def _under(key: str, path: str) -> bool:
    return key == path or key.startswith((f"{path}.", f"{path}["))
