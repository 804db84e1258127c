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
               if name.split(".")[0] not in sys.stdlib_module_names | {CONTRACT.name}
               and not name.startswith("launcher.in_trainer")]
    assert not foreign, f"{path.name} imports {foreign} at module level; import them inside the function"


def test_the_checker_reaches_into_subpackages():
    assert IN_TRAINER / "selftest" / "kernels.py" in IN_TRAINER_MODULES


def test_the_checker_sees_a_foreign_import(tmp_path):
    module = tmp_path / "bad.py"
    module.write_text("import json\nimport yaml\nfrom launcher.runs import tiny\n\ndef f():\n    import torch\n")
    assert top_level_imports(module) == ["json", "yaml", "launcher.runs"]


LAUNCHER = IN_TRAINER.parent
OVERLAY = LAUNCHER.parent / "overlay" / "toolkit"
CONTRACT = LAUNCHER.parent / "flux2_contract"
CONTRACT_MODULES = sorted(path.stem for path in CONTRACT.glob("*.py") if path.stem != "__init__")


def shared_names() -> set[str]:
    from flux2_contract import files

    return {value for name, value in vars(files).items() if name.isupper() and isinstance(value, str)}


def spelled_names(source: str, names: set[str]) -> list[str]:
    """The shared file names a module writes as a string literal of its own (docstrings hold prose)."""
    return sorted({node.value for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Constant) and node.value in names})


def test_the_overlay_imports_the_shared_file_names_instead_of_spelling_them():
    names = shared_names()
    assert spelled_names("MANIFEST = 'checkpoint.json'\n", names) == ["checkpoint.json"]
    spelled = {path.name: found for path in sorted(OVERLAY.glob("*.py"))
               if (found := spelled_names(path.read_text(encoding="utf-8"), names))}
    assert not spelled, f"import these from flux2_contract.files instead: {spelled}"


def contract_imports_by_another_name(source: str) -> list[str]:
    """Imports of a contract module as if it were the trainer's (`toolkit.settings`, `.qtypes`,
    `from toolkit import memory_plan`): in the checkout those names do not exist."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            named = [alias.name for alias in node.names] if module == "toolkit" or (node.level and not module) else []
            if module.removeprefix("toolkit.") in CONTRACT_MODULES and (node.level or module.startswith("toolkit.")):
                found.append(("." * node.level) + module)
            found += [f"{module or '.'} import {name}" for name in named if name in CONTRACT_MODULES]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.removeprefix("toolkit.") in CONTRACT_MODULES
                      and alias.name.startswith("toolkit.")]
    return found


def test_the_overlay_imports_the_contract_by_its_name():
    assert contract_imports_by_another_name(
        "from .settings import read\nimport toolkit.qtypes as q\nfrom toolkit import memory_plan, int4_linear\n"
        "from flux2_contract import settings\n") == [".settings", "toolkit.qtypes", "toolkit import memory_plan"]
    found = {path.name: wrong for path in sorted(OVERLAY.glob("*.py"))
             if (wrong := contract_imports_by_another_name(path.read_text(encoding="utf-8")))}
    assert not found, f"import these from flux2_contract: {found}"


def test_the_train_loop_reads_the_flag_files_by_the_contract_names():
    """`save` and `stop` write the flag files the flag-files hook reads: flux2_hooks names them by
    flux2_contract.files (the overlay test above keeps it from spelling them), and no patch spells
    them in code of its own."""
    from flux2_contract.files import SAVE_NOW, STOP_NOW

    hooks = ast.parse((OVERLAY / "flux2_hooks.py").read_text(encoding="utf-8"))
    used = {node.attr for node in ast.walk(hooks)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "files"}
    assert {"SAVE_NOW", "STOP_NOW"} <= used, "flux2_hooks no longer checks the flag files by the contract's names"
    spelled = sorted(path.name for path in (LAUNCHER.parent / "patches").rglob("*.patch")
                     for line in path.read_text(encoding="utf-8").splitlines()
                     if line.startswith("+") and (f"'{SAVE_NOW}'" in line or f"'{STOP_NOW}'" in line))
    assert not spelled, f"call flux2_hooks.check_flag_files instead of spelling the flag files in {spelled}"


@pytest.mark.parametrize("name", CONTRACT_MODULES)
def test_the_contract_imports_in_a_bare_interpreter(name):
    """No site-packages (no PyYAML, no torch, no GitPython): the launcher and the trainer import the
    contract before either has anything else, and it imports neither of them."""
    code = (f"import sys; sys.path.insert(0, {str(CONTRACT.parent)!r})\n"
            f"import flux2_contract.{name}\n"
            "assert not {'launcher', 'toolkit'} & set(sys.modules), 'the contract imported a side'")
    result = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_bare_interpreter_has_no_third_party_package():
    result = subprocess.run([sys.executable, "-I", "-S", "-c", "import yaml"], capture_output=True, text=True)
    assert result.returncode != 0 and "yaml" in result.stderr


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
    graph = overlay_imports()
    assert {"int4_kernels", "int4_w4a8"} <= graph["int4_linear"]
    assert cycle_in(graph) is None


def test_the_presets_and_the_planner_import_without_gitpython():
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
    assert set(CONTRACT_MODULES) <= named["flux2_contract/"], sorted(set(CONTRACT_MODULES) - named["flux2_contract/"])
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
