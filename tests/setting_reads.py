"""The trainer side's read rule, checked on Python's AST: every model_kwargs setting of the catalogue
(flux2_contract/settings.py) is read through one of the catalogue's readers (`settings.read`),
with the setting's name as a literal, never around them (`kwargs.get("key", default)`,
`kwargs["key"]`, `"key" in kwargs`), whatever the quotes, the alias the mapping was given
(`kw = cfg.model_kwargs`, `getattr(cfg, "model_kwargs")`) or the name the reader was imported as.

Used on the overlay's files as they are and on a patched trainer checkout, where only the lines the
series added are judged (upstream's own code is not the project's to route)."""

from __future__ import annotations

import ast
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

CATALOGUE_MODULE = "settings"
"""flux2_contract/settings.py, imported as `flux2_contract.settings`, `.settings` or `from flux2_contract import settings`."""
MAPPING_METHODS = {"get", "pop", "setdefault"}
HUNK = re.compile(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", re.M)


@dataclass
class Reads:
    """What one module does with the catalogue's settings."""

    through: dict[str, list[range]] = field(default_factory=dict)
    """setting -> the lines of each read through a reader"""
    around: list[tuple[range, str]] = field(default_factory=list)
    """(lines, what): each read around the readers, or a reader given no literal setting name"""


def readers(catalogue_source: str) -> set[str]:
    """The catalogue's readers: its module-level functions whose first two parameters are
    (model_kwargs, name) (`read`, and `cache_folder`, which reads a folder setting)."""
    found = set()
    for node in ast.parse(catalogue_source).body:
        if isinstance(node, ast.FunctionDef):
            names = [arg.arg for arg in node.args.args[:2]]
            if names == ["model_kwargs", "name"]:
                found.add(node.name)
    return found


def check(source: str, settings: set[str], reader_names: set[str], is_catalogue: bool = False) -> Reads:
    """The reads of `settings` (the catalogue's model_kwargs names) in one module's source."""
    return _Module(ast.parse(source), settings, reader_names, is_catalogue).reads()


def _lines(node: ast.AST) -> range:
    return range(node.lineno, node.end_lineno + 1)


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _Module:
    def __init__(self, tree: ast.Module, settings: set[str], reader_names: set[str], is_catalogue: bool) -> None:
        self.tree, self.settings, self.reader_names = tree, settings, reader_names
        self.is_catalogue = is_catalogue
        self.reader_aliases = set(reader_names) if is_catalogue else set()
        self.module_aliases: set[str] = set()
        self.mapping_aliases: set[str] = set()
        self._imports()
        self._aliases()

    def _imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                for name in node.names:
                    if module.split(".")[-1] == CATALOGUE_MODULE and name.name in self.reader_names:
                        self.reader_aliases.add(name.asname or name.name)
                    elif name.name == CATALOGUE_MODULE:
                        self.module_aliases.add(name.asname or name.name)
            elif isinstance(node, ast.Import):
                for name in node.names:
                    if name.name.split(".")[-1] == CATALOGUE_MODULE:
                        self.module_aliases.add(name.asname or name.name)

    def _aliases(self) -> None:
        """Names bound anywhere in the module to a model_kwargs mapping, to a fixed point
        (`kw = cfg.model_kwargs or {}`; `kw2 = dict(kw)`)."""
        bindings = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                bindings += [(target, node.value) for target in node.targets if isinstance(target, ast.Name)]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and isinstance(node.target, ast.Name) and node.value:
                bindings.append((node.target, node.value))
        grown = True
        while grown:
            grown = False
            for target, value in bindings:
                if target.id not in self.mapping_aliases and self.is_mapping(value):
                    self.mapping_aliases.add(target.id)
                    grown = True

    def is_mapping(self, node: ast.AST) -> bool:
        """Whether `node` is the model_kwargs mapping (or a name, copy or fallback of it)."""
        if isinstance(node, ast.Name):
            return node.id in self.mapping_aliases or node.id.endswith("kwargs")
        if isinstance(node, ast.Attribute):
            return node.attr.endswith("kwargs")
        if isinstance(node, ast.Subscript):
            return (_literal(node.slice) or "").endswith("kwargs")
        if isinstance(node, ast.BoolOp):
            return any(self.is_mapping(value) for value in node.values)
        if isinstance(node, ast.IfExp):
            return self.is_mapping(node.body) or self.is_mapping(node.orelse)
        if isinstance(node, ast.Dict):
            return any(key is None and self.is_mapping(value) for key, value in zip(node.keys, node.values))
        if isinstance(node, ast.Call):
            func, args = node.func, node.args
            if isinstance(func, ast.Name) and func.id == "getattr" and len(args) >= 2:
                return (_literal(args[1]) or "").endswith("kwargs")
            if isinstance(func, ast.Name) and func.id == "dict" and len(args) == 1:
                return self.is_mapping(args[0])
            if isinstance(func, ast.Attribute) and func.attr == "get" and args:
                return (_literal(args[0]) or "").endswith("kwargs")
        return False

    def is_reader(self, func: ast.AST) -> bool:
        if isinstance(func, ast.Name):
            return func.id in self.reader_aliases
        return (isinstance(func, ast.Attribute) and func.attr in self.reader_names
                and isinstance(func.value, ast.Name) and func.value.id in self.module_aliases)

    def reads(self) -> Reads:
        found = Reads()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and self.is_reader(node.func):
                key = _literal(node.args[1]) if len(node.args) >= 2 else None
                if key in self.settings:
                    found.through.setdefault(key, []).append(_lines(node))
                elif not self.is_catalogue:  # the catalogue's own `complete` reads every name in turn
                    found.around.append((_lines(node), f"{ast.unparse(node)}: not a catalogue setting by its literal name"))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MAPPING_METHODS and node.args and self.is_mapping(node.func.value) \
                    and _literal(node.args[0]) in self.settings:
                found.around.append((_lines(node), ast.unparse(node)))
            elif isinstance(node, ast.Subscript) and self.is_mapping(node.value) and _literal(node.slice) in self.settings:
                found.around.append((_lines(node), ast.unparse(node)))
            elif isinstance(node, ast.Compare) and _literal(node.left) in self.settings \
                    and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                    and any(self.is_mapping(right) for right in node.comparators):
                found.around.append((_lines(node), ast.unparse(node)))
        found.around.sort(key=lambda item: item[0].start)
        return found


def added_lines(checkout: Path, base: str) -> dict[str, set[int]]:
    """{path: the line numbers of HEAD's file that commits after `base` added}, for the .py files."""
    diff = subprocess.run(["git", "-C", str(checkout), "diff", "--no-color", "--no-ext-diff", "-U0", base, "HEAD",
                           "--", "*.py"], check=True, capture_output=True, text=True, encoding="utf-8").stdout
    added: dict[str, set[int]] = {}
    for part in diff.split("\ndiff --git "):
        path = re.search(r"^\+\+\+ b/(.+)$", part, re.M)
        if path is None:
            continue  # a deleted file
        lines = added.setdefault(path.group(1), set())
        for hunk in HUNK.finditer(part):
            start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
            lines.update(range(start, start + count))
    return added


def checkout_reads(checkout: Path, base: str, settings: set[str]) -> dict[str, Reads]:
    """{path: Reads} of the lines the commits after `base` (overlay and series) added to HEAD's files,
    read from git, so edits left in the work tree are not judged."""
    catalogue = _show(checkout, "flux2_contract/settings.py")
    reader_names = readers(catalogue)
    judged = {}
    for path, lines in added_lines(checkout, base).items():
        found = check(_show(checkout, path), settings, reader_names, is_catalogue=path == "flux2_contract/settings.py")
        judged[path] = Reads({key: kept for key, spans in found.through.items()
                              if (kept := [span for span in spans if lines.intersection(span)])},
                             [(span, what) for span, what in found.around if lines.intersection(span)])
    return judged


def _show(checkout: Path, path: str) -> str:
    return subprocess.run(["git", "-C", str(checkout), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True, encoding="utf-8").stdout
