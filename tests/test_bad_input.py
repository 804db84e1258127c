"""Every bad input of setup / verify / patches gets a clear error before long work starts."""

import json

import pytest
from conftest import write_files
from test_setup import TWO_PATCHES

from launcher.envs.workdir import Workdir


def run_setup(upstream, tmp_path, *extra) -> int:
    return upstream.launcher("setup", "--workdir", str(tmp_path / "wd"), "--no-install", *extra)


def test_git_missing(upstream, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GIT_PYTHON_GIT_EXECUTABLE", str(tmp_path / "no-such-git"))
    assert run_setup(upstream, tmp_path) == 2
    assert "git was not found" in capsys.readouterr().err


def test_unreachable_url_names_it_and_the_mirror_setting(upstream, tmp_path, capsys):
    url = (tmp_path / "nowhere").as_uri()
    upstream.write_lock(upstream.base)
    upstream.lock.write_text(upstream.lock.read_text().replace(upstream.url, url))
    assert run_setup(upstream, tmp_path) == 2
    err = capsys.readouterr().err
    assert url in err and "insteadOf" in err
    assert not (tmp_path / "wd" / "trainer").exists()


def test_commit_not_in_the_clone(upstream, tmp_path, capsys):
    upstream.write_lock("0123456789abcdef0123456789abcdef01234567")
    assert run_setup(upstream, tmp_path) == 2
    err = capsys.readouterr().err
    assert "0123456789abcdef0123456789abcdef01234567" in err and "not in" in err


def test_short_commit_in_the_lock(upstream, tmp_path, capsys):
    upstream.write_lock(upstream.base[:12])
    assert run_setup(upstream, tmp_path) == 2
    assert "full 40-hex hash" in capsys.readouterr().err


def test_a_failing_patch_is_named_with_files_and_command(upstream, tmp_path, capsys):
    upstream.make_series(TWO_PATCHES)
    write_files(upstream.repo_dir, {"toolkit/util/quantize.py": "def quantize():\n    return 'upstream'\n"})
    upstream.write_lock(upstream.commit("upstream rewrites quantize"))
    assert run_setup(upstream, tmp_path) == 2
    err = capsys.readouterr().err
    assert "quantize-loud" in err and "toolkit/util/quantize.py" in err
    assert "apply --check -v" in err and "patches check" in err
    assert not (tmp_path / "wd" / "trainer").exists(), "a half-patched checkout must not look finished"


def test_unknown_target_suggests_the_closest(upstream, tmp_path, capsys):
    assert run_setup(upstream, tmp_path, "--target", "fixtur") == 2
    err = capsys.readouterr().err
    assert "unknown target 'fixtur'" in err and "did you mean `fixture`?" in err


def test_series_naming_a_missing_file(upstream, tmp_path, capsys):
    upstream.series.write_text("0001-gone.patch\n")
    assert run_setup(upstream, tmp_path) == 2
    err = capsys.readouterr().err
    assert "0001-gone.patch" in err and "series:1" in err


def test_patch_in_the_folder_but_not_in_the_series(upstream, tmp_path, capsys):
    names = upstream.make_series(TWO_PATCHES)
    upstream.series.write_text(names[0] + "\n")
    assert run_setup(upstream, tmp_path) == 2
    err = capsys.readouterr().err
    assert names[1] in err and "does not list" in err


def test_edited_patch_is_refused_before_cloning(upstream, tmp_path, capsys):
    names = upstream.make_series(TWO_PATCHES)
    patch = upstream.series.parent / names[1]
    patch.write_text(patch.read_text().replace("return 2", "return 3"))
    assert run_setup(upstream, tmp_path) == 2
    assert names[1] in capsys.readouterr().err
    assert not (tmp_path / "wd").exists()


def test_exclude_that_is_not_a_folder(upstream, tmp_path, capsys):
    upstream.write_lock(upstream.base, exclude=["run.py"])
    assert run_setup(upstream, tmp_path) == 2
    assert "exclude entry run.py/" in capsys.readouterr().err


def test_workdir_of_another_target(upstream, tmp_path, capsys):
    assert run_setup(upstream, tmp_path) == 0
    state = Workdir(tmp_path / "wd").state_file
    state.write_text(state.read_text().replace('"fixture"', '"other"'))
    assert run_setup(upstream, tmp_path) == 2
    assert "other" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["targets: [", "targets: []", "targets:\n  - name: x\n"])
def test_malformed_lock(upstream, tmp_path, capsys, text):
    upstream.lock.write_text(text)
    assert run_setup(upstream, tmp_path) == 2
    assert str(upstream.lock) in capsys.readouterr().err


def test_workdir_that_is_a_file(upstream, tmp_path, capsys):
    (tmp_path / "wd").write_text("my notes")
    assert run_setup(upstream, tmp_path) == 2
    assert f"the workdir {tmp_path / 'wd'} is a file" in capsys.readouterr().err
    assert (tmp_path / "wd").read_text() == "my notes"


@pytest.mark.parametrize("entry", ["trainer", "trainer.partial", "venv", "setup-state.json"])
def test_workdir_entry_that_links_out_is_refused(upstream, tmp_path, capsys, entry):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (tmp_path / "wd").mkdir()
    target = outside / "keep.txt" if entry.endswith(".json") else outside
    try:
        (tmp_path / "wd" / entry).symlink_to(target, target_is_directory=target.is_dir())
    except OSError as error:  # Windows without the symlink privilege
        pytest.skip(f"cannot create a link here: {error}")
    assert run_setup(upstream, tmp_path) == 2
    assert f"{tmp_path / 'wd' / entry} leads out of the workdir" in capsys.readouterr().err
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("damage", ["missing", "half-written", "not an object"])
def test_a_missing_or_damaged_state_file_is_rewritten(upstream, tmp_path, capsys, damage):
    assert run_setup(upstream, tmp_path) == 0
    state = Workdir(tmp_path / "wd").state_file
    good = json.loads(state.read_text())
    assert run_setup(upstream, tmp_path) == 0
    assert "rewrote" not in capsys.readouterr().out, "an intact state file is left alone"
    if damage == "missing":
        state.unlink()
    elif damage == "half-written":
        state.write_text(state.read_text()[:40])
    else:
        state.write_text("[1, 2]")
    assert run_setup(upstream, tmp_path) == 0
    assert f"rewrote {state}" in capsys.readouterr().out
    assert json.loads(state.read_text()) == good


def test_a_file_where_the_checkout_belongs(upstream, tmp_path, capsys):
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "trainer").write_text("not a checkout")
    assert run_setup(upstream, tmp_path) == 2
    assert "trainer is a file where the launcher keeps a folder" in capsys.readouterr().err
    assert (tmp_path / "wd" / "trainer").read_text() == "not a checkout"
