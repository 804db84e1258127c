"""No host sync between the forward and the backward (the SDTrainer patch).

`if loss.item() > 1e3: pass` copied the loss to the host before every backward and did nothing
with it: the CPU waited for the whole forward before it could queue the first backward kernel.
On a CPU machine there is no device to wait for, so the guard reads the trainer's own code: in
every SDTrainer method that hands a tensor to `self.accelerator.backward`, no statement before that
call reads the same tensor back to the host (`.item()`, `.tolist()`, `.cpu()`, `float(...)`) and
throws the value away (an `if` whose body is only `pass`, or a bare expression). Reads whose value
is used (upstream logs the loss in its opt-in preservation pass) are the trainer's business.
"""

import ast
from pathlib import Path

import pytest

TRAINER_FILE = "extensions_built_in/sd_trainer/SDTrainer.py"
HOST_READS = ("item", "tolist", "cpu", "numpy")


def _reads(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls under `node` that copy tensor `name` to the host."""
    found = []
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        method_read = (isinstance(call.func, ast.Attribute) and call.func.attr in HOST_READS
                       and isinstance(call.func.value, ast.Name) and call.func.value.id == name)
        float_read = (isinstance(call.func, ast.Name) and call.func.id == "float" and call.args
                      and isinstance(call.args[0], ast.Name) and call.args[0].id == name)
        if method_read or float_read:
            found.append(call)
    return found


def _discarded(statement: ast.stmt) -> ast.AST | None:
    """The part of `statement` whose value nobody uses: a bare expression, or the test of an `if`
    that only passes."""
    if isinstance(statement, ast.Expr):
        return statement.value
    if isinstance(statement, ast.If) and all(isinstance(s, ast.Pass) for s in statement.body) and not statement.orelse:
        return statement.test
    return None


def host_reads_before_backward(source: str) -> list[str]:
    """'method:line: read' for each host read of a tensor, its value thrown away, before the
    backward that tensor feeds."""
    found = []
    for method in ast.walk(ast.parse(source)):
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        backwards = [(call.lineno, call.args[0].id) for call in ast.walk(method) if isinstance(call, ast.Call)
                     and isinstance(call.func, ast.Attribute) and call.func.attr == "backward"
                     and call.args and isinstance(call.args[0], ast.Name)]
        for line, name in backwards:
            for statement in ast.walk(method):
                part = _discarded(statement) if isinstance(statement, ast.stmt) else None
                if part is None or statement.lineno >= line:
                    continue
                found += [f"{method.name}:{call.lineno}: {ast.unparse(call)}" for call in _reads(part, name)]
    return found


def test_the_guard_sees_a_host_read_before_the_backward():
    source = "class T:\n    def step(self, loss):\n        if loss.item() > 1e3:\n            pass\n" \
             "        self.accelerator.backward(loss)\n"
    assert host_reads_before_backward(source) == ["step:3: loss.item()"]
    assert host_reads_before_backward(source.replace("loss.item()", "other.item()")) == []
    used = "class T:\n    def step(self, loss):\n        self.logs['loss'] = loss.item()\n" \
           "        self.accelerator.backward(loss)\n"
    assert host_reads_before_backward(used) == []


def test_no_host_read_of_the_loss_before_its_backward(trainer_checkout):
    path = Path(trainer_checkout) / TRAINER_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing")
    found = host_reads_before_backward(path.read_text(encoding="utf-8"))
    assert not found, f"{TRAINER_FILE} reads the loss on the host before its backward (a sync every step): {found}"
