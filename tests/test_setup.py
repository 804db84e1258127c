"""setup / verify / patches check against fixture upstream repositories (no network)."""

import git
import pytest
from conftest import git_run, write_files

from launcher.envs.workdir import Workdir

TWO_PATCHES = [
    ("model: first change", {"toolkit/model.py": "".join(f"line {i}\n" for i in range(1, 31)).replace("line 5\n", "line five\n")}),
    ("quantize: loud", {"toolkit/util/quantize.py": "def quantize():\n    return 2\n", "toolkit/util/new.py": "NEW = 1\n"}),
]


@pytest.fixture
def patched(upstream, tmp_path):
    names = upstream.make_series(TWO_PATCHES)
    workdir = Workdir(tmp_path / "wd")
    assert upstream.launcher("setup", "--workdir", str(workdir.root), "--no-install") == 0
    return upstream, workdir, names


def test_setup_pins_excludes_and_applies_the_series_as_commits(patched):
    upstream, workdir, names = patched
    repo = git.Repo(workdir.trainer)
    commits = list(repo.iter_commits(f"{upstream.base}..HEAD", reverse=True))
    assert [c.summary for c in commits] == ["model: first change", "quantize: loud"]
    assert all(c.author.name == "Fixture Author" for c in commits)
    assert commits[0].message.endswith("Description: fixture patch\nWall: none\n")
    assert commits[0].parents[0].hexsha == upstream.base
    assert repo.active_branch.name == "patched"
    assert not (workdir.trainer / "toolkit" / "keymaps").exists()
    assert (workdir.trainer / "toolkit" / "__init__.py").exists()
    assert (workdir.trainer / "docs" / "readme.md").exists()
    assert (workdir.trainer / "toolkit" / "util" / "new.py").read_text() == "NEW = 1\n"
    assert "line five" in (workdir.trainer / "toolkit" / "model.py").read_text()
    assert len(names) == 2


def test_setup_twice_does_nothing_and_says_so(patched, capsys):
    upstream, workdir, _ = patched
    head = git.Repo(workdir.trainer).head.commit.hexsha
    capsys.readouterr()
    assert upstream.launcher("setup", "--workdir", str(workdir.root), "--no-install") == 0
    assert "up to date" in capsys.readouterr().out
    assert git.Repo(workdir.trainer).head.commit.hexsha == head


def test_two_setups_give_the_same_history(patched, tmp_path):
    upstream, workdir, _ = patched
    other = tmp_path / "other"
    assert upstream.launcher("setup", "--workdir", str(other), "--no-install") == 0
    assert git.Repo(other / "trainer").head.commit.hexsha == git.Repo(workdir.trainer).head.commit.hexsha


def test_verify_passes_on_a_fresh_checkout(patched, capsys):
    upstream, workdir, _ = patched
    assert upstream.launcher("verify", "--workdir", str(workdir.root)) == 0
    assert "ok:" in capsys.readouterr().out


@pytest.mark.parametrize("drift, expected", [
    ("edit", "uncommitted change"),
    ("untracked", "uncommitted change: ?? stray.py"),
    ("commit", "is not part of the series"),
    ("amend", "changes other files than patch"),
])
def test_verify_names_what_drifted(patched, capsys, drift, expected):
    upstream, workdir, _ = patched
    trainer = workdir.trainer
    if drift == "edit":
        (trainer / "run.py").write_text("print('edited')\n")
    elif drift == "untracked":
        (trainer / "stray.py").write_text("")
    elif drift == "commit":
        (trainer / "run.py").write_text("print('edited')\n")
        git_run(trainer, "commit", "-qam", "local work")
    elif drift == "amend":
        (trainer / "run.py").write_text("print('edited')\n")
        git_run(trainer, "commit", "-q", "--amend", "-a", "--no-edit")
    capsys.readouterr()
    assert upstream.launcher("verify", "--workdir", str(workdir.root)) == 1
    assert expected in capsys.readouterr().out


def test_verify_names_ignored_files_python_would_execute(patched, capsys):
    upstream, workdir, _ = patched
    trainer = workdir.trainer
    (trainer / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pth\n")  # as the trainer's .gitignore
    bytecode = trainer / "toolkit" / "__pycache__" / "model.cpython-311.pyc"
    bytecode.parent.mkdir()
    bytecode.write_bytes(b"planted")
    (trainer / "hook.pth").write_text("import os\n")
    capsys.readouterr()
    assert upstream.launcher("verify", "--workdir", str(workdir.root)) == 1
    out = capsys.readouterr().out
    assert "ignored file Python would execute: hook.pth" in out
    assert "ignored file Python would execute: toolkit/__pycache__/model.cpython-311.pyc" in out


def test_verify_detects_a_changed_patch_file(patched, capsys):
    upstream, workdir, names = patched
    patch = upstream.series.parent / names[0]
    patch.write_text(patch.read_text() + "\n")
    assert upstream.launcher("verify", "--workdir", str(workdir.root)) == 2
    assert names[0] in capsys.readouterr().err


def test_verify_detects_another_locked_commit(patched, capsys):
    upstream, workdir, _ = patched
    write_files(upstream.repo_dir, {"run.py": "print('newer')\n"})
    newer = upstream.commit("upstream moves on")
    upstream.write_lock(newer)
    assert upstream.launcher("verify", "--workdir", str(workdir.root)) == 1
    assert "locked commit" in capsys.readouterr().out


def test_setup_refuses_a_dirty_workdir_and_changes_nothing(patched, capsys):
    upstream, workdir, _ = patched
    (workdir.trainer / "run.py").write_text("print('my edit')\n")
    assert upstream.launcher("setup", "--workdir", str(workdir.root), "--no-install") == 2
    err = capsys.readouterr().err
    assert "run.py" in err and "Nothing was changed" in err
    assert (workdir.trainer / "run.py").read_text() == "print('my edit')\n"


def test_setup_refuses_a_workdir_built_for_another_series(patched, capsys):
    upstream, workdir, _ = patched
    upstream.make_series(TWO_PATCHES[:1])
    assert upstream.launcher("setup", "--workdir", str(workdir.root), "--no-install") == 2
    assert "not part of the series" in capsys.readouterr().err


def test_patches_check_reports_clean_three_way_and_conflict(upstream, capsys):
    upstream.make_series([
        ("clean one", {"docs/readme.md": "docs\nmore docs\n"}),
        ("needs merge", {"toolkit/model.py": "".join(f"line {i}\n" for i in range(1, 31)).replace("line 20\n", "line twenty\n")}),
        ("conflicts", {"toolkit/util/quantize.py": "def quantize():\n    return 'patched'\n"}),
    ])
    # Upstream moves: context near line 20 shifts (3-way needed), quantize.py is rewritten (conflict).
    text = "".join(f"line {i}\n" for i in range(1, 31)).replace("line 18\n", "line eighteen\n").replace("line 22\n", "line 22 moved\n")
    write_files(upstream.repo_dir, {"toolkit/model.py": text, "toolkit/util/quantize.py": "def quantize():\n    return 'upstream'\n"})
    moved = upstream.commit("upstream rewrites")
    capsys.readouterr()
    assert upstream.launcher("patches", "check", "--ref", moved) == 1
    rows = {line.split("|")[0].strip(): line for line in capsys.readouterr().out.splitlines() if "|" in line}
    assert "| clean" in next(v for k, v in rows.items() if "clean-one" in k)
    assert "needs 3-way" in next(v for k, v in rows.items() if "needs-merge" in k)
    conflict_row = next(v for k, v in rows.items() if "conflicts" in k)
    assert "conflict" in conflict_row and "toolkit/util/quantize.py" in conflict_row


def test_patches_check_passes_at_the_locked_commit(upstream, capsys):
    upstream.make_series(TWO_PATCHES)
    assert upstream.launcher("patches", "check") == 0
    assert "all 2 patches apply" in capsys.readouterr().out


def test_export_is_deterministic(upstream):
    upstream.make_series(TWO_PATCHES)
    first = {p.name: p.read_bytes() for p in upstream.series.parent.iterdir()}
    upstream.make_series(TWO_PATCHES)
    assert {p.name: p.read_bytes() for p in upstream.series.parent.iterdir()} == first
