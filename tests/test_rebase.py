"""rebase: clean, 3-way, conflict (continue / skip / abort), absorbed, --write, determinism."""

import git
import pytest
import yaml
from conftest import write_files

from launcher.patching.series import read_series

MODEL = "".join(f"line {i}\n" for i in range(1, 31))
SERIES = [
    ("clean one", {"docs/readme.md": "docs\nmore docs\n"}),
    ("needs merge", {"toolkit/model.py": MODEL.replace("line 20\n", "line twenty\n")}),
    ("conflicts", {"toolkit/util/quantize.py": "def quantize():\n    return 'patched'\n"}),
]


@pytest.fixture
def moved(upstream):
    """A series of three patches and an upstream commit that shifts one and conflicts another."""
    upstream.make_series(SERIES)
    write_files(upstream.repo_dir, {
        "toolkit/model.py": MODEL.replace("line 18\n", "line eighteen\n").replace("line 22\n", "line 22 moved\n"),
        "toolkit/util/quantize.py": "def quantize():\n    return 'upstream'\n",
    })
    git_tag = upstream.commit("upstream moves")
    return upstream, git_tag


def rebase(upstream, tmp_path, *args):
    return upstream.launcher("rebase", "--workdir", str(tmp_path / "wd"), *args)


def test_conflict_stops_with_files_hunks_and_commands(moved, tmp_path, capsys):
    upstream, onto = moved
    assert rebase(upstream, tmp_path, "--onto", onto) == 1
    out = capsys.readouterr().out
    assert "clean-one.patch: applied clean" in out
    assert "needs-merge.patch: applied via 3-way merge" in out
    assert "CONFLICT in toolkit/util/quantize.py" in out
    assert "toolkit/util/quantize.py: @@ -1,2 +1,2 @@" in out
    assert "rebase --continue" in out and "rebase --skip" in out and "rebase --abort" in out
    conflicted = tmp_path / "wd" / "rebase" / "fixture" / "trainer" / "toolkit" / "util" / "quantize.py"
    assert "<<<<<<<" in conflicted.read_text()


def test_continue_after_resolving_then_write(moved, tmp_path, capsys):
    upstream, onto = moved
    assert rebase(upstream, tmp_path, "--onto", onto) == 1
    scratch = tmp_path / "wd" / "rebase" / "fixture" / "trainer"
    assert rebase(upstream, tmp_path, "--continue") == 2  # still unresolved
    assert "still unresolved" in capsys.readouterr().err
    (scratch / "toolkit" / "util" / "quantize.py").write_text("def quantize():\n    return 'both'\n")
    git.Repo(scratch).git.add("toolkit/util/quantize.py")
    assert rebase(upstream, tmp_path, "--continue", "--write") == 0
    out = capsys.readouterr().out
    assert "conflicts.patch: resolved" in out and "all 3 patches apply" in out
    assert yaml.safe_load(upstream.lock.read_text())["targets"][0]["commit"] == onto
    assert "return 'both'" in (upstream.series.parent / read_series(upstream.series)[2].name).read_text()
    assert upstream.launcher("patches", "check") == 0


def test_skip_drops_the_patch_and_records_why(moved, tmp_path, capsys):
    upstream, onto = moved
    assert rebase(upstream, tmp_path, "--onto", onto) == 1
    assert rebase(upstream, tmp_path, "--skip", "--reason", "upstream returns the right value", "--write") == 0
    names = [p.name for p in read_series(upstream.series)]
    assert len(names) == 2 and not any("conflicts" in n for n in names)
    assert "# dropped 0003-conflicts.patch: upstream returns the right value" in upstream.series.read_text()
    assert not list(upstream.series.parent.glob("*conflicts*"))


def test_abort_leaves_the_repository_alone(moved, tmp_path):
    upstream, onto = moved
    before = {p.name: p.read_bytes() for p in upstream.series.parent.iterdir()}
    lock_before = upstream.lock.read_text()
    assert rebase(upstream, tmp_path, "--onto", onto) == 1
    assert rebase(upstream, tmp_path, "--abort") == 0
    assert not (tmp_path / "wd" / "rebase" / "fixture").exists()
    assert {p.name: p.read_bytes() for p in upstream.series.parent.iterdir()} == before
    assert upstream.lock.read_text() == lock_before
    assert rebase(upstream, tmp_path, "--continue") == 2


def test_absorbed_patch_is_dropped_automatically(upstream, tmp_path, capsys):
    upstream.make_series(SERIES[:2])
    write_files(upstream.repo_dir, {"docs/readme.md": "docs\nmore docs\n"})
    onto = upstream.commit("upstream takes the docs change")
    assert rebase(upstream, tmp_path, "--onto", onto, "--write") == 0
    assert "absorbed upstream" in capsys.readouterr().out
    assert len(read_series(upstream.series)) == 1


def test_without_write_the_result_lands_in_the_workdir(moved, tmp_path):
    upstream, onto = moved
    lock_before = upstream.lock.read_text()
    assert rebase(upstream, tmp_path, "--onto", onto) == 1
    assert rebase(upstream, tmp_path, "--skip") == 0
    assert upstream.lock.read_text() == lock_before
    assert len(read_series(tmp_path / "wd" / "rebase" / "fixture" / "series" / "series")) == 2


def test_rebase_onto_the_same_commit_reexports_byte_identical(upstream, tmp_path):
    upstream.make_series(SERIES)
    before = {p.name: p.read_bytes() for p in upstream.series.parent.iterdir()}
    assert rebase(upstream, tmp_path, "--onto", upstream.base, "--write") == 0
    assert {p.name: p.read_bytes() for p in upstream.series.parent.iterdir()} == before


def test_printed_commands_name_the_target_and_workdir(moved, tmp_path, capsys):
    upstream, onto = moved
    assert rebase(upstream, tmp_path, "--onto", onto) == 1
    out = capsys.readouterr().out
    options = f"--target fixture --workdir {tmp_path / 'wd'}"
    for action in ("--continue", "--skip", "--abort"):
        assert f"python -m launcher rebase {action} {options}" in out


def test_finished_rebase_without_write_can_be_adopted_with_continue_write(moved, tmp_path, capsys):
    upstream, onto = moved
    assert rebase(upstream, tmp_path, "--onto", onto) == 1
    assert rebase(upstream, tmp_path, "--skip", "--reason", "upstream has it") == 0
    assert "rebase --continue --write --target fixture" in capsys.readouterr().out
    assert rebase(upstream, tmp_path, "--continue", "--write") == 0  # nothing redone
    assert yaml.safe_load(upstream.lock.read_text())["targets"][0]["commit"] == onto
    assert len(read_series(upstream.series)) == 2
    assert "# dropped 0003-conflicts.patch: upstream has it" in upstream.series.read_text()
    assert not (tmp_path / "wd" / "rebase" / "fixture" / "state.json").exists()


def test_patch_git_cannot_merge_applies_what_fits_and_leaves_rej_files(upstream, tmp_path, capsys):
    # the second patch's pre-image of model.py exists only in the series author's clone
    upstream.make_series([
        ("first", {"toolkit/model.py": MODEL.replace("line 5\n", "line five\n")}),
        ("second", {
            "toolkit/model.py": MODEL.replace("line 5\n", "line five\n").replace("line 25\n", "line 25 patched\n"),
            "docs/readme.md": "docs\nsecond\n",
        }),
    ])
    write_files(upstream.repo_dir, {"toolkit/model.py": MODEL.replace("line 25\n", "line 25 upstream\n")})
    onto = upstream.commit("upstream changes line 25")
    assert rebase(upstream, tmp_path, "--onto", onto) == 1
    out = capsys.readouterr().out
    assert "0002-second.patch: CONFLICT in toolkit/model.py" in out and "toolkit/model.py.rej" in out
    scratch = tmp_path / "wd" / "rebase" / "fixture" / "trainer"
    assert (scratch / "docs" / "readme.md").read_text() == "docs\nsecond\n"  # the hunk that fits
    assert "docs/readme.md" in git.Repo(scratch).git.diff("--cached", "--name-only")
    assert rebase(upstream, tmp_path, "--continue") == 2  # the .rej file is still there
    assert "toolkit/model.py.rej" in capsys.readouterr().err
    model = scratch / "toolkit" / "model.py"
    model.write_text(model.read_text().replace("line 25 upstream\n", "line 25 patched upstream\n"))
    (scratch / "toolkit" / "model.py.rej").unlink()
    git.Repo(scratch).git.add("toolkit/model.py")
    assert rebase(upstream, tmp_path, "--continue", "--write") == 0
    second = (upstream.series.parent / read_series(upstream.series)[1].name).read_text()
    assert "+line 25 patched upstream" in second and "+second" in second
