"""The real fork: the series applies, verifies and compiles; the installed venv imports it.

Skipped with the reason when the fork cannot be cloned (no network and no mirror).
"""

import compileall
import os
import subprocess

import pytest

from conftest import FORK
from launcher.cli import main
from launcher.series import read_series
from launcher.workdir import venv_python


@pytest.fixture(scope="module")
def fork_checkout(tmp_path_factory, fork_reachable):
    root = tmp_path_factory.mktemp("fork")
    assert main(["setup", "--workdir", str(root), "--no-install"]) == 0
    return root


def test_every_patch_applies_in_order_without_three_way(fork_reachable, capsys):
    assert main(["patches", "check"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.count("|") == 2]
    results = {name.strip(): status.strip() for name, status, _ in rows[2:]}
    assert results == {p.name: "clean" for p in read_series(FORK.series)}


def test_setup_then_verify(fork_checkout, capsys):
    assert main(["verify", "--workdir", str(fork_checkout)]) == 0
    assert "no other change" in capsys.readouterr().out


def test_patched_tree_byte_compiles(fork_checkout):
    trainer = fork_checkout / "trainer"
    for folder in ("toolkit", "extensions_built_in", "jobs"):
        assert compileall.compile_dir(trainer / folder, quiet=1, force=True, legacy=False,
                                      workers=1, ddir=folder), f"{folder} does not byte-compile"


def test_installed_venv_imports_the_trainer(trainer_workdir):
    python = venv_python(trainer_workdir.venv)
    probe = "import torch, torchaudio, toolkit, toolkit.job; print(torch.__version__, torchaudio.__version__)"
    result = subprocess.run([str(python), "-c", probe], cwd=trainer_workdir.trainer,
                            capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0].startswith("2.11.0")
