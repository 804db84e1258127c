"""The overlay: new trainer files kept once in the project, committed before every target's series."""

import git
from conftest import git_run, write_files

from launcher.patching import overlay

MODULE = "def streamed():\n    return 'one copy'\n"


def with_overlay(upstream, files: dict[str, str]):
    """Give the fixture lock an overlay folder holding `files`, and a one-patch series hooking it in."""
    write_files(upstream.root / "overlay", files)
    upstream.write_lock(upstream.base, overlay="overlay")
    upstream.make_series([("hook the module in", {"run.py": "import toolkit.streamed\nprint('trainer')\n"})])


def setup(upstream, tmp_path):
    workdir = tmp_path / "wd"
    assert upstream.launcher("setup", "--workdir", str(workdir), "--no-install") == 0
    return workdir, git.Repo(workdir / "trainer")


def test_setup_commits_the_overlay_first_then_the_hooks(upstream, tmp_path):
    with_overlay(upstream, {"toolkit/streamed.py": MODULE})
    workdir, repo = setup(upstream, tmp_path)
    subjects = [c.summary for c in repo.iter_commits(f"{upstream.base}..HEAD", reverse=True)]
    assert subjects == [overlay.SUBJECT, "hook the module in"]
    assert (workdir / "trainer" / "toolkit" / "streamed.py").read_text() == MODULE
    first = next(repo.iter_commits(f"{upstream.base}..HEAD", reverse=True))
    assert first.author.email == overlay.EMAIL and first.committer.email == overlay.EMAIL


def test_two_setups_give_the_same_overlay_commit(upstream, tmp_path):
    with_overlay(upstream, {"toolkit/streamed.py": MODULE})
    _, first = setup(upstream, tmp_path / "a")
    _, second = setup(upstream, tmp_path / "b")
    assert first.head.commit.hexsha == second.head.commit.hexsha


def test_verify_names_an_overlay_that_changed_since_setup(upstream, tmp_path, capsys):
    with_overlay(upstream, {"toolkit/streamed.py": MODULE})
    workdir, _ = setup(upstream, tmp_path)
    assert upstream.launcher("verify", "--workdir", str(workdir)) == 0
    (upstream.root / "overlay" / "toolkit" / "streamed.py").write_text(MODULE + "# edited\n")
    assert upstream.launcher("verify", "--workdir", str(workdir)) == 1
    assert "differs from the project's overlay/ folder" in capsys.readouterr().out


def test_export_moves_new_files_to_the_overlay_and_keeps_hooks_in_patches(upstream, tmp_path):
    with_overlay(upstream, {"toolkit/streamed.py": MODULE})
    workdir, repo = setup(upstream, tmp_path)
    trainer = workdir / "trainer"
    write_files(trainer, {"toolkit/streamed.py": MODULE + "# fixed in the checkout\n",
                          "toolkit/new_module.py": "NEW = 1\n",
                          "toolkit/model.py": "hooked\n"})
    git_run(trainer, "add", "-A")
    git_run(trainer, "commit", "-q", "-m", "hook a new module\n\nDescription: x\n")
    assert upstream.launcher("patches", "export", "--repo", str(trainer)) == 0
    folder = upstream.root / "overlay" / "toolkit"
    assert (folder / "streamed.py").read_text().endswith("# fixed in the checkout\n")
    assert (folder / "new_module.py").read_text() == "NEW = 1\n"
    patches = sorted(upstream.series.parent.glob("*.patch"))
    assert [p.name[5:] for p in patches] == ["hook-the-module-in.patch", "hook-a-new-module.patch"]
    text = "".join(p.read_text() for p in patches)
    assert "toolkit/model.py" in text and "streamed.py" not in text and "new_module.py" not in text
    assert upstream.launcher("patches", "check") == 0


def test_export_keeps_the_series_comments(upstream, tmp_path):
    with_overlay(upstream, {"toolkit/streamed.py": MODULE})
    upstream.series.write_text(upstream.series.read_text() + "# not ported yet: a patch of the other target\n")
    workdir, _ = setup(upstream, tmp_path)
    assert upstream.launcher("patches", "export", "--repo", str(workdir / "trainer")) == 0
    assert "# not ported yet: a patch of the other target\n" in upstream.series.read_text()


def test_an_overlay_file_that_upstream_now_has_is_refused(upstream, tmp_path, capsys):
    with_overlay(upstream, {"toolkit/util/quantize.py": MODULE})
    assert upstream.launcher("setup", "--workdir", str(tmp_path / "wd"), "--no-install") != 0
    assert "upstream now has files the overlay adds: toolkit/util/quantize.py" in capsys.readouterr().err


def test_verify_and_check_speak_json(upstream, tmp_path, capsys):
    import json

    with_overlay(upstream, {"toolkit/streamed.py": MODULE})
    workdir, _ = setup(upstream, tmp_path)
    capsys.readouterr()
    assert upstream.launcher("verify", "--workdir", str(workdir), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["overlay_files"] == 1 and report["problems"] == []
    assert upstream.launcher("patches", "check", "--json") == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["ok"] and [p["result"] for p in checked["patches"]] == ["clean"]
