"""No host sync between the forward and the backward (the SDTrainer patch).

`if loss.item() > 1e3: pass` copied the loss to the host before every backward and did nothing
with it: the CPU waited for the whole forward before it could queue the first backward kernel.
On a CPU machine there is no device to wait for, so the guard reads the trainer's own code: in
every SDTrainer method that hands a tensor to `self.accelerator.backward`, nothing before that
call reads the same tensor back to the host (`.item()`, `.tolist()`, `.cpu()`, `float(...)`).
"""

import ast
from pathlib import Path

import pytest

TRAINER_FILE = "extensions_built_in/sd_trainer/SDTrainer.py"
HOST_READS = ("item", "tolist", "cpu", "numpy")


def host_reads_before_backward(source: str) -> list[str]:
    """'method:line: name.item()' for each host read of a tensor before the backward it feeds."""
    found = []
    for method in ast.walk(ast.parse(source)):
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = [node for node in ast.walk(method) if isinstance(node, ast.Call)]
        backwards = [(call.lineno, call.args[0].id) for call in calls
                     if isinstance(call.func, ast.Attribute) and call.func.attr == "backward"
                     and call.args and isinstance(call.args[0], ast.Name)]
        for line, name in backwards:
            for call in calls:
                if call.lineno >= line:
                    continue
                method_read = (isinstance(call.func, ast.Attribute) and call.func.attr in HOST_READS
                               and isinstance(call.func.value, ast.Name) and call.func.value.id == name)
                float_read = (isinstance(call.func, ast.Name) and call.func.id == "float" and call.args
                              and isinstance(call.args[0], ast.Name) and call.args[0].id == name)
                if method_read or float_read:
                    found.append(f"{method.name}:{call.lineno}: {ast.unparse(call)}")
    return found


def test_the_guard_sees_a_host_read_before_the_backward():
    source = "class T:\n    def step(self, loss):\n        if loss.item() > 1e3:\n            pass\n" \
             "        self.accelerator.backward(loss)\n"
    assert host_reads_before_backward(source) == ["step:3: loss.item()"]
    assert host_reads_before_backward(source.replace("loss.item()", "other.item()")) == []


def test_no_host_read_of_the_loss_before_its_backward(trainer_checkout):
    path = Path(trainer_checkout) / TRAINER_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing")
    found = host_reads_before_backward(path.read_text(encoding="utf-8"))
    assert not found, f"{TRAINER_FILE} reads the loss on the host before its backward (a sync every step): {found}"
