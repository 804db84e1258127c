"""The layout's promises: modules run under the trainer's interpreter import only what it has."""

import ast
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


@pytest.mark.parametrize("path", sorted(IN_TRAINER.glob("*.py")), ids=lambda p: p.name)
def test_in_trainer_modules_import_only_the_standard_library(path):
    foreign = [name for name in top_level_imports(path)
               if name.split(".")[0] not in sys.stdlib_module_names
               and not name.startswith("launcher.in_trainer")]
    assert not foreign, f"{path.name} imports {foreign} at module level; import them inside the function"


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
