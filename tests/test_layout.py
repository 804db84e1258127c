"""The layout's promises: modules run under the trainer's interpreter import only what it has."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

IN_TRAINER = Path(__file__).resolve().parent.parent / "launcher" / "in_trainer"


def top_level_imports(path: Path) -> list[str]:
    """Modules imported at module level (not inside functions, where heavy imports belong)."""
    names = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


IN_TRAINER_MODULES = sorted(IN_TRAINER.rglob("*.py"))
"""Every module under in_trainer/, its subpackages (the self-test's) included."""


@pytest.mark.parametrize("path", IN_TRAINER_MODULES, ids=lambda p: p.relative_to(IN_TRAINER).as_posix())
def test_in_trainer_modules_import_only_the_standard_library(path):
    foreign = [name for name in top_level_imports(path)
               if name.split(".")[0] not in sys.stdlib_module_names
               and not name.startswith("launcher.in_trainer") and name not in TRAINER_SAFE]
    assert not foreign, f"{path.name} imports {foreign} at module level; import them inside the function"


TRAINER_SAFE = {"launcher.families"}
"""Launcher modules outside in_trainer/ that in-trainer code may import: standard library only themselves."""


@pytest.mark.parametrize("name", sorted(TRAINER_SAFE))
def test_the_modules_in_trainer_code_may_import_need_only_the_standard_library(name):
    path = IN_TRAINER.parent.joinpath(*name.split(".")[1:]).with_suffix(".py")
    foreign = [module for module in top_level_imports(path) if module.split(".")[0] not in sys.stdlib_module_names]
    assert not foreign, f"{path.name} imports {foreign}; code run under the trainer's interpreter imports it"


def test_the_checker_reaches_into_subpackages():
    assert IN_TRAINER / "selftest" / "kernels.py" in IN_TRAINER_MODULES


def test_the_checker_sees_a_foreign_import(tmp_path):
    module = tmp_path / "bad.py"
    module.write_text("import json\nimport yaml\nfrom launcher.runs import tiny\n\ndef f():\n    import torch\n")
    assert top_level_imports(module) == ["json", "yaml", "launcher.runs"]


def test_the_trainer_side_spells_every_shared_name_the_same():
    from launcher.runs.files import SHARED_WITH_TRAINER

    root = IN_TRAINER.parents[1]
    trainer_side = "".join(p.read_text(encoding="utf-8") for p in sorted((root / "overlay").rglob("*.py")))
    trainer_side += "".join(p.read_text(encoding="utf-8") for p in sorted((root / "patches").rglob("*.patch")))
    missing = [name for name in SHARED_WITH_TRAINER if f"'{name}'" not in trainer_side and f'"{name}"' not in trainer_side]
    assert not missing, f"overlay/ and patches/ never spell {missing}"


LAUNCHER = IN_TRAINER.parent
OVERLAY_READ_BY_THE_LAUNCHER = ("qtypes", "safetensors_header", "qcache_index", "settings", "memory_plan")
OVERLAY = LAUNCHER.parent / "overlay" / "toolkit"


def package_imports() -> dict[str, set[str]]:
    """{launcher subpackage: the other launcher subpackages its modules import, anywhere in them};
    a nested package (in_trainer/selftest) counts as part of the top one."""
    graph: dict[str, set[str]] = {}
    for path in LAUNCHER.glob("*/**/*.py"):
        package = path.relative_to(LAUNCHER).parts[0]
        found = graph.setdefault(package, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in modules:
                parts = name.split(".")
                if parts[0] == "launcher" and len(parts) > 1 and (LAUNCHER / parts[1]).is_dir() and parts[1] != package:
                    found.add(parts[1])
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between packages, or None."""
    def visit(node, path):
        if node in path:
            return path[path.index(node):] + [node]
        for other in sorted(graph.get(node, ())):
            found = visit(other, path + [node])
            if found:
                return found
        return None

    return next((found for node in sorted(graph) if (found := visit(node, []))), None)


def test_launcher_packages_import_each_other_without_a_cycle():
    """runs and watchdog both read the trainer log and the GPU: those live below both (signals)."""
    assert cycle_in({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    graph = package_imports()
    assert set(graph) == {init.parent.name for init in LAUNCHER.glob("*/__init__.py")}, "every subpackage is read"
    assert cycle_in(graph) is None


def overlay_imports() -> dict[str, set[str]]:
    """{overlay module: the overlay modules it imports, at module level or inside a function}."""
    names = {path.stem for path in OVERLAY.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in OVERLAY.glob("*.py"):
        found = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                module = (node.module or "").removeprefix("toolkit.") if node.level == 0 else node.module or ""
                if node.module == "toolkit" or (node.level and not node.module):
                    found |= {alias.name for alias in node.names if alias.name in names}
                elif module in names and (node.level or node.module.startswith("toolkit.")):
                    found.add(module)
            elif isinstance(node, ast.Import):
                found |= {alias.name.removeprefix("toolkit.") for alias in node.names
                          if alias.name.startswith("toolkit.") and alias.name.removeprefix("toolkit.") in names}
    return graph


def test_overlay_modules_import_each_other_without_a_cycle():
    """The qtype table and the settings sit below the 4-bit Linear and its kernels, never above."""
    graph = overlay_imports()
    assert {"settings"} <= graph["qtypes"] and "int4_linear" not in graph["qtypes"]
    assert cycle_in(graph) is None


@pytest.mark.parametrize("name", OVERLAY_READ_BY_THE_LAUNCHER)
def test_overlay_modules_the_launcher_imports_are_stdlib_only(name):
    """The launcher imports these overlay modules without the trainer's venv (no torch)."""
    path = LAUNCHER.parent / "overlay" / "toolkit" / f"{name}.py"
    foreign = [module for module in top_level_imports(path)
               if module.split(".")[0] not in sys.stdlib_module_names and module != "__future__"]
    assert not foreign, f"{path.name} imports {foreign} at module level: the launcher imports it without torch"


def test_the_presets_and_the_bridge_import_without_gitpython():
    """bench/fullsize.py reads presets with a GPU machine's plain python3, which has no GitPython."""
    code = ("import sys; sys.modules['git'] = None\n"
            "from launcher.runs.presets import read_preset\n"
            "from launcher.runs.memory_plan import streams_on\n"
            "assert read_preset('rtx16gb_512').data['config']['name']")
    result = subprocess.run([sys.executable, "-c", code], cwd=LAUNCHER.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def layer_map() -> dict[str, set[str]]:
    """{folder of launcher/: the module names docs/design.md's layer map gives it}: every word of a
    line's description that is not inside parentheses, the folder's own lines continued below it."""
    text = (LAUNCHER.parent / "docs" / "design.md").read_text(encoding="utf-8")
    block = text[text.index("```\nlauncher/cli.py"):]
    block = block[:block.index("\n```", 4)]
    folders: dict[str, str] = {}
    current = None
    for line in block.splitlines()[1:]:
        head, rest = line[:29].strip(), line[29:]
        if head:
            current = head
        folders[current] = folders.get(current, "") + " " + rest
    named = {}
    for folder, words in folders.items():
        depth, kept = 0, []
        for char in words:
            depth += char == "("
            kept.append(char if depth == 0 else " ")
            depth -= char == ")"
        named[folder] = set(re.findall(r"\b([a-z][a-z0-9_]*)\b", "".join(kept)))
    return named


def test_the_layer_map_names_every_module_and_no_module_that_is_gone():
    named = layer_map()
    for folder in sorted({path.parent for path in LAUNCHER.rglob("*.py")}):
        if "in_trainer" in folder.parts or folder.name == "__pycache__":
            continue
        key = "launcher/ (top level)" if folder == LAUNCHER else f"{folder.relative_to(LAUNCHER.parent).as_posix()}/"
        modules = {path.stem for path in folder.glob("*.py")} - {"__init__", "__main__", "cli"}
        assert key in named, f"docs/design.md's layer map has no line for {key}"
        missing = modules - named[key]
        assert not missing, f"docs/design.md's layer map does not name {sorted(missing)} under {key}"
    trainer_side = {path.stem for path in IN_TRAINER.rglob("*.py")} - {"__init__"}
    assert trainer_side <= named["launcher/in_trainer/"], sorted(trainer_side - named["launcher/in_trainer/"])
    known = {path.stem for path in LAUNCHER.rglob("*.py")} | {path.name for path in LAUNCHER.rglob("*") if path.is_dir()}
    for folder, words in named.items():
        if folder.startswith("launcher/") and folder != "launcher/cli.py":
            gone = words - known - {"and"}  # outside parentheses a line holds module names only
            assert not gone, f"docs/design.md's layer map names what is no module under {folder}: {sorted(gone)}"


def module_name(path: Path) -> str:
    """launcher/selftest/cards.py -> launcher.selftest.cards (a package's __init__: the package)."""
    parts = path.relative_to(LAUNCHER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def launcher_imports(path: Path, known: set[str]) -> set[str]:
    """The launcher modules `path` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & known


def doc_only(imports: dict[str, set[str]], generators: set[str]) -> set[str]:
    """The modules only the doc generators import, directly or through others of their own."""
    found: set[str] = set()
    while True:
        grown = {name for name in imports if name not in generators | found
                 and (importers := {other for other, used in imports.items() if name in used})
                 and importers <= generators | found}
        if not grown:
            return found
        found |= grown


def names_bench_results(path: Path) -> list[int]:
    """Lines of `path` whose code names the bench folder or a path under bench/results: a string
    "bench", or one holding "bench/results" (either slash); a bare string statement (a docstring) is
    prose and left alone."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return sorted(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in prose and (node.value == "bench" or "bench/results" in node.value.replace("\\", "/")))


def test_only_the_doc_generators_read_bench_results():
    """bench/ is a maintainer's folder an install need not have: measured figures reach run-time code
    as shipped files (launcher/step_prediction.csv), and only the doc generators (*_doc.py) and the
    modules they alone import read bench/results."""
    paths = {module_name(path): path for path in LAUNCHER.rglob("*.py") if "__pycache__" not in path.parts}
    imports = {name: launcher_imports(path, set(paths)) for name, path in paths.items()}
    generators = {module_name(path) for path in LAUNCHER.glob("*_doc.py")}
    allowed = generators | doc_only(imports, generators)
    assert "launcher.selftest.cards" in allowed and "launcher.step_prediction" not in allowed
    readers = {name: lines for name, path in sorted(paths.items()) if name not in allowed
               and (lines := names_bench_results(path))}
    assert not readers, f"run-time modules that name bench/results (module: lines): {readers}"


def test_the_bench_results_checker_sees_a_path_and_leaves_prose_alone(tmp_path):
    module = tmp_path / "reader.py"
    module.write_text('"""Figures from bench/results/step.csv."""\nfrom pathlib import Path\n\n'
                      'ROOT = Path(__file__).parents[1] / "bench" / "results"\n"""Where bench/results lies."""\n'
                      'NAME = f"{ROOT}\\\\bench\\\\results\\\\step.csv"\nSEE = "bench/RESULTS.md"\n', encoding="utf-8")
    assert names_bench_results(module) == [4, 6]


def test_a_module_another_imports_is_no_doc_generator_s_alone():
    imports = {"a_doc": {"cards", "table"}, "cards": {"table", "paper"}, "paper": set(), "table": set(),
               "run": {"table"}, "cycle": {"loop"}, "loop": {"cycle"}}
    assert doc_only(imports, {"a_doc"}) == {"cards", "paper"}
