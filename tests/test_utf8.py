"""UTF-8 end to end, the rules Windows needs and Linux never shows: the launcher's own output never
raises on a character, every child Python is told to speak UTF-8 and is read as UTF-8, every text
file is opened with its encoding named, and nothing the project writes into the trainer's source
carries a non-ASCII byte (torch.compile reads that source; ostris/ai-toolkit#953)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.envs import trainer_python
from launcher.envs.torchenv import UTF8_CHILD, clean_env

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(REPO / "launcher").rglob("*.py"), *(REPO / "overlay").rglob("*.py")])
SUBPROCESS_CALLS = {"run", "Popen", "check_output", "check_call", "call"}


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((item.value for item in call.keywords if item.arg == name), None)


def binary_mode(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else keyword(call, "mode")
    return isinstance(mode, ast.Constant) and "b" in str(mode.value)


def text_calls_without_encoding(source: str) -> list[tuple[int, str]]:
    """(line, what) of each call that reads or writes text in the platform's default encoding: a
    text-mode subprocess, `open()` in text mode, `Path.read_text`/`write_text`, a `TextIOWrapper`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or keyword(node, "encoding") is not None:
            continue
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
        if name in SUBPROCESS_CALLS and (keyword(node, "text") or keyword(node, "universal_newlines")) is not None:
            found.append((node.lineno, f"subprocess.{name}(text=...)"))
        elif name == "open" and isinstance(function, ast.Name) and not binary_mode(node):
            found.append((node.lineno, "open()"))
        elif name == "read_text" and isinstance(function, ast.Attribute) and not node.args:
            found.append((node.lineno, ".read_text()"))
        elif name == "write_text" and isinstance(function, ast.Attribute) and len(node.args) < 2:
            found.append((node.lineno, ".write_text()"))
        elif name == "TextIOWrapper" and len(node.args) < 2:
            found.append((node.lineno, "TextIOWrapper()"))
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.relative_to(REPO).as_posix())
def test_every_text_read_and_write_names_its_encoding(path):
    found = text_calls_without_encoding(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(REPO)}: the platform's encoding (cp1252 on Windows) at {found}"


def test_the_rule_sees_each_kind_of_default_encoding():
    source = ("import subprocess, io\n"
              "subprocess.run(['x'], capture_output=True, text=True)\n"
              "open(name)\n"
              "open(name, 'rb')\n"
              "path.read_text()\n"
              "path.write_text('x')\n"
              "io.TextIOWrapper(raw)\n"
              "subprocess.run(['x'], text=True, encoding='utf-8')\n"
              "path.read_text(encoding='utf-8')\n")
    assert [line for line, _ in text_calls_without_encoding(source)] == [2, 3, 5, 6, 7]


def added_lines(patch: Path) -> list[tuple[int, bytes]]:
    """The lines a patch adds to the trainer's source, not its header, its context or what it removes
    (those are the upstream's own lines)."""
    body = patch.read_bytes().split(b"\n")
    start = next(index for index, line in enumerate(body) if line.startswith(b"diff --git"))
    return [(index + 1, line) for index, line in enumerate(body[start:], start)
            if line.startswith(b"+") and not line.startswith(b"+++ ")]


PATCHES = sorted((REPO / "patches").glob("*/*.patch"))


@pytest.mark.parametrize("patch", PATCHES, ids=lambda path: f"{path.parent.name}/{path.name[:4]}")
def test_no_patch_adds_a_non_ascii_byte_to_the_trainer(patch):
    found = [number for number, line in added_lines(patch) if not line.isascii()]
    assert not found, f"{patch.relative_to(REPO)} adds non-ASCII bytes at lines {found}: write them in ASCII"


@pytest.mark.parametrize("path", [*(REPO / "overlay").rglob("*.py"), *(REPO / "launcher").rglob("*.py")],
                         ids=lambda path: path.relative_to(REPO).as_posix())
def test_no_source_line_of_the_overlay_or_the_launcher_is_non_ascii(path):
    found = [number for number, line in enumerate(path.read_bytes().split(b"\n"), 1) if not line.isascii()]
    assert not found, f"{path.relative_to(REPO)}: non-ASCII bytes at lines {found}"


def test_every_child_python_is_told_to_speak_utf8(monkeypatch):
    monkeypatch.setenv("PYTHONUTF8", "0")  # the user's own setting would make a Windows child cp1252 again
    monkeypatch.delenv("PYTHONIOENCODING", raising=False)
    assert clean_env()["PYTHONUTF8"] == "1" and clean_env()["PYTHONIOENCODING"] == "utf-8"
    assert trainer_python.child_env()["PYTHONUTF8"] == "1"
    child = subprocess.run([sys.executable, "-c", "import sys; print(sys.flags.utf8_mode, sys.stdout.encoding)"],
                           capture_output=True, text=True, encoding="utf-8", env=clean_env(), check=True)
    assert child.stdout.split() == ["1", "utf-8"]
    assert set(UTF8_CHILD) == {"PYTHONUTF8", "PYTHONIOENCODING"}


def test_the_launcher_prints_any_name_to_a_pipe_that_the_platform_would_write_in_cp1252(tmp_path):
    """As on Windows with its output to a pipe: the interpreter starts in cp1252 (PYTHONIOENCODING),
    the launcher's first line shows a workdir it cannot encode; it must print it, in UTF-8."""
    workdir = tmp_path / "данные_日本_张"
    env = {**os.environ, "PYTHONIOENCODING": "cp1252", "PYTHONUTF8": "0"}
    result = subprocess.run([sys.executable, "-m", "launcher", "run", "presets/tiny.yaml", "--workdir", str(workdir),
                             "--dry-run"], cwd=REPO, capture_output=True, env=env)
    output = (result.stdout + result.stderr).decode("utf-8")
    assert "UnicodeEncodeError" not in output and "Traceback" not in output, output[-3000:]
    assert "данные_日本_张" in output, output[-3000:]
