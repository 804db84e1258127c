"""Presets and run configs read with limits: a size cap and a budget for alias expansion.

YAML anchors and aliases share one object, so ten nested aliases of ten items each load in
microseconds and stand for 10^10 values; whatever walks the result (the schema check, an error
message's repr, yaml.safe_dump of the rendered config, the trainer) then expands it and runs
out of memory. A preset needs neither megabytes nor millions of values: the composed node graph
is measured (each node counted as often as aliases reach it, memoized, so measuring costs only
the distinct nodes) and refused over the budget, before any value is built.
"""

from pathlib import Path

import yaml

from launcher.errors import LauncherError

MAX_BYTES = 1 * 2**20
MAX_NODES = 100_000
"""Values after alias expansion; the largest shipped preset has about 150."""


class _Budget(Exception):
    pass


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document whose aliases expand beyond MAX_NODES values."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node, sizes: dict, open_nodes: set) -> int:
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise _Budget("a value that contains itself (an alias to one of its own parents)")
    open_nodes.add(key)
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else [])
    size = 1 + sum(_expanded_size(child, sizes, open_nodes) for child in children)
    open_nodes.discard(key)
    if size > MAX_NODES:
        raise _Budget(f"more than {MAX_NODES:,} values once its aliases (*name) are expanded")
    sizes[key] = size
    return size


def load_yaml(path: Path):
    """The parsed YAML file; any problem (size, aliases, syntax, encoding) is a LauncherError naming it."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise LauncherError(f"{path} is {size:,} bytes; a preset or run config is a few kB (at most "
                                f"{MAX_BYTES:,} bytes are read): is it the right file?")
        with path.open("rb") as handle:
            text = handle.read(MAX_BYTES + 1).decode("utf-8")
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except OSError as error:
        raise LauncherError(f"{path} cannot be read ({error.strerror or error})") from None
    except _Budget as error:
        raise LauncherError(f"{path} is refused: it holds {error}; write the values out instead") from None
    except (yaml.YAMLError, ValueError, RecursionError) as error:  # ValueError: bad UTF-8, a 5000-digit int
        raise LauncherError(f"{path} is not valid YAML: {type(error).__name__}: {_cut(str(error))}") from None


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."
