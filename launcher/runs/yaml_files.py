"""Presets and run configs read with limits: a size cap and a budget for alias expansion.

YAML anchors and aliases share one object, so ten nested aliases of ten items each load in
microseconds and stand for 10^10 values; whatever walks the result (the schema check, an error
message's repr, yaml.safe_dump of the rendered config, the trainer) then expands it and runs
out of memory. A string aliased a thousand times is one node per alias but stands for a thousand
copies of its text, which the dry run prints. A preset needs neither megabytes of text nor millions
of values: the composed node graph is measured (each node counted as often as aliases reach it,
with the characters of its text, memoized, so measuring costs only the distinct nodes) and refused
over either budget, before any value is built. The file itself is read by launcher/user_files.py
(regular files only, a size cap, UTF-8 only).

PyYAML also reads some text differently from how it looks, silently: a key given twice keeps the
last value (`lr: 0.0001` then `lr: 0.5` trains at 0.5), and YAML 1.1 integers read `017` as 15
(octal), `0x10` as 16, `0b11` as 3 and `1:30` as 90 (base 60). Those are refused with their line.
The line of every key is kept too (`load_yaml_lines`), so a schema problem can name its line.
"""

import re
from pathlib import Path

import yaml

from launcher.errors import LauncherError
from launcher.user_files import KINDS, decode, read_bytes

MAX_BYTES = KINDS["preset"][0]
MAX_NODES = 100_000
"""Values after alias expansion; the largest shipped preset has about 150."""
MAX_EXPANDED_CHARS = 4 * MAX_BYTES
"""Characters of text after alias expansion: a few times what the file itself may hold."""


class _Budget(Exception):
    pass


class _Refused(Exception):
    """Text PyYAML would read as something other than what it looks like, at a line."""

    def __init__(self, node, message: str) -> None:
        super().__init__(message)
        self.line = node.start_mark.line + 1
        self.message = message


YAML11_NUMBERS = (
    # (the form, its name): PyYAML's YAML 1.1 resolver turns these into numbers no reader expects
    (re.compile(r"[-+]?0b[0-1_]+"), "binary"),
    (re.compile(r"[-+]?0x[0-9a-fA-F_]+"), "hexadecimal"),
    (re.compile(r"[-+]?0[0-7_]+"), "octal"),
    (re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"), "base-60"),
)
MERGE_TAG = "tag:yaml.org,2002:merge"


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document whose aliases expand beyond MAX_NODES values, a key
    given twice in one mapping and the YAML 1.1 number forms; `key_lines` maps each key path
    (`config.process[0].train.lr`, as the schema writes it) to its line."""

    key_lines: dict[str, int]

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        self.key_lines = {}
        _record_lines(node, "", self.key_lines)
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: SafeLoader says so itself
                    continue
                if first != key_node.start_mark.line + 1:
                    raise _Refused(key_node, f"the key `{key}` is given twice in one mapping (first on line {first}); "
                                             "YAML would keep only the last value: remove one")
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        _refuse_yaml11_number(node, lambda: super(BoundedLoader, self).construct_yaml_int(node))
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        _refuse_yaml11_number(node, lambda: super(BoundedLoader, self).construct_yaml_float(node))
        return super().construct_yaml_float(node)


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
BoundedLoader.add_constructor("tag:yaml.org,2002:float", BoundedLoader.construct_yaml_float)


def _refuse_yaml11_number(node, read) -> None:
    value = str(node.value)
    for form, name in YAML11_NUMBERS:
        if form.fullmatch(value):
            raise _Refused(node, f"`{value}` is a YAML 1.1 {name} number (read as {read()}), not what it looks like; "
                                 f"write the number in plain decimal, or quote it ('{value}') to mean text")


def _record_lines(node, path: str, lines: dict[str, int]) -> None:
    """The line of every key and list item under `node` (aliases are bounded by now)."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            where = f"{path}.{key_node.value}" if path else str(key_node.value)
            lines.setdefault(where, key_node.start_mark.line + 1)
            _record_lines(value_node, where, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            where = f"{path}[{index}]"
            lines.setdefault(where, item.start_mark.line + 1)
            _record_lines(item, where, lines)


def _expanded_size(node, sizes: dict, open_nodes: set) -> tuple[int, int]:
    """(values, characters of text) that `node` stands for once its aliases are expanded."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise _Budget("a value that contains itself (an alias to one of its own parents)")
    open_nodes.add(key)
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else [])
    values, chars = 1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0
    for child in children:
        more = _expanded_size(child, sizes, open_nodes)
        values, chars = values + more[0], chars + more[1]
    open_nodes.discard(key)
    if values > MAX_NODES:
        raise _Budget(f"more than {MAX_NODES:,} values once its aliases (*name) are expanded")
    if chars > MAX_EXPANDED_CHARS:
        raise _Budget(f"more than {MAX_EXPANDED_CHARS:,} characters of text once its aliases (*name) are expanded")
    sizes[key] = (values, chars)
    return values, chars


def load_yaml(path: Path):
    """The parsed YAML file; any problem (size, aliases, syntax, encoding, a key given twice, a YAML 1.1
    number form) is a LauncherError naming it."""
    return load_yaml_lines(path)[0]


def load_yaml_lines(path: Path) -> tuple[object, dict[str, int]]:
    """`load_yaml`, and the line of each key path (`config.process[0].train.lr`: 42)."""
    text = decode(path, read_bytes(path, "preset"))
    try:
        loader = BoundedLoader(text)
        try:
            return loader.get_single_data(), getattr(loader, "key_lines", {})
        finally:
            loader.dispose()
    except _Refused as error:
        raise LauncherError(f"{path}, line {error.line}: {error.message}") from None
    except _Budget as error:
        raise LauncherError(f"{path} is refused: it holds {error}; write the values out instead") from None
    except (yaml.YAMLError, ValueError, RecursionError) as error:  # ValueError: a 5000-digit int
        raise LauncherError(f"{path} is not valid YAML: {type(error).__name__}: {_cut(str(error))}") from None


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."
