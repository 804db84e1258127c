"""torch before triton in every module of the project that imports triton: with TheRock's ROCm on
Windows, a triton loaded first makes torch's HIP DLLs fail to load (triton-lang/triton-windows#35).

Inductor's compile workers need nothing from here: torch 2.13 sets `compile_threads` to 1 on win32
(torch/_inductor/config.py `decide_compile_threads`), so no worker process exists, and a worker
started with TORCHINDUCTOR_COMPILE_THREADS imports torch._inductor before triton
(torch/_inductor/compile_worker/__main__.py)."""

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*ROOT.glob("overlay/**/*.py"), *ROOT.glob("launcher/**/*.py"), *ROOT.glob("bench/**/*.py")]


def imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def is_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def triton_before_torch(tree: ast.Module) -> list[int]:
    """Lines of the module's own statements (what runs at import, `try`/`if` blocks included) that
    import triton with no torch import before them. Imports inside functions run later, after the
    caller's torch: the trainer-venv test below checks those processes as they start."""
    found: list[int] = []
    torch_seen = False
    pending = list(tree.body)
    while pending:
        statement = pending.pop(0)
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        names = imported(statement)
        torch_seen |= any(is_package(name, "torch") for name in names)
        if any(is_package(name, "triton") for name in names) and not torch_seen:
            found.append(statement.lineno)
        inner = [s for field in ("body", "orelse", "finalbody") for s in getattr(statement, field, []) or []]
        inner += [s for handler in getattr(statement, "handlers", []) for s in handler.body]
        pending[:0] = [s for s in inner if isinstance(s, ast.stmt)]
    return found


@pytest.mark.parametrize("path", [p for p in SOURCES if "triton" in p.read_text(encoding="utf-8")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_torch_is_imported_before_triton(path):
    lines = triton_before_torch(ast.parse(path.read_text(encoding="utf-8")))
    assert not lines, f"{path.relative_to(ROOT)}: triton imported before torch at lines {lines}"


def test_the_check_catches_a_triton_first_module():
    assert triton_before_torch(ast.parse("import triton\nimport torch\n")) == [1]
    assert triton_before_torch(ast.parse("try:\n    import triton\nexcept ImportError:\n    pass\nimport torch\n")) == [2]
    assert triton_before_torch(ast.parse("import torch\ndef f():\n    from triton import jit\n")) == []
    assert triton_before_torch(ast.parse("try:\n    import torch\nexcept ImportError:\n    pass\nimport triton\n")) == []


ENTRY_IMPORTS = {
    # module -> the process that imports it: `run` (run.py imports toolkit.job), the self-test, the
    # ISA check, the 4-bit kernels, the Windows ROCm probe
    "toolkit.job": "run.py", "launcher.in_trainer.selftest.runner": "selftest",
    "launcher.in_trainer.kernel_isa": "selftest", "toolkit.int4_kernels": "run.py",
    "toolkit.int4_w4a8": "run.py", "launcher.in_trainer.rocm_windows_probe": "setup",
}
ORDER_HOOK = """
import importlib, sys
class Guard:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" and "torch" not in sys.modules:
            raise SystemExit("triton imported before torch")
        return None
sys.meta_path.insert(0, Guard())
importlib.import_module(sys.argv[1])
"""


@pytest.mark.trainer
@pytest.mark.parametrize("module", sorted(ENTRY_IMPORTS))
def test_trainer_processes_import_torch_before_triton(trainer_workdir, module):
    """Each process's import chain in the trainer venv, with a guard that fails the first triton
    import made before torch's."""
    import subprocess

    from launcher.envs.trainer_python import LAUNCHER_ROOT, child_env
    from launcher.envs.workdir import venv_python

    python = venv_python(trainer_workdir.venv)
    env = child_env(None, python)
    env["PYTHONPATH"] = f"{LAUNCHER_ROOT}{os.pathsep}{trainer_workdir.trainer}"
    result = subprocess.run([str(python), "-c", ORDER_HOOK, module], cwd=trainer_workdir.trainer, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{module} ({ENTRY_IMPORTS[module]}): {result.stderr.strip()[-500:]}"
