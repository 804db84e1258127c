"""The entry point is the one error boundary: whatever reaches it becomes one `error:` line that
says what to do, never a bare traceback; a bug's traceback goes to a file named in that line."""

import argparse
import errno
import json
import subprocess
import sys

import pytest

from launcher import cli, errors


def main_raising(monkeypatch, error: BaseException) -> int:
    def handler(args):
        raise error

    parser = argparse.ArgumentParser()
    parser.set_defaults(handler=handler)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    return cli.main([])


@pytest.mark.parametrize("error, says", [
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x/config.yaml"),
     "/runs/x/config.yaml: No space left on device; the disk is full"),
    (PermissionError(errno.EACCES, "Permission denied", "/data/images"), "/data/images: Permission denied; permission denied"),
    (OSError(errno.ENAMETOOLONG, "File name too long", "/r/" + "x" * 300), "the name is too long"),
    (RecursionError("maximum recursion depth exceeded"), "nests too deeply"),
    (MemoryError(), "out of host memory"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "not valid utf-8"),
])
def test_an_os_level_error_is_one_line_naming_the_file_and_what_to_do(monkeypatch, capsys, error, says):
    assert main_raising(monkeypatch, error) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    assert "Traceback" not in err


def test_a_bug_is_one_line_with_the_report_command_and_its_traceback_in_a_file(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(errors, "TRACEBACK_FILE", tmp_path / "traceback.txt")
    assert main_raising(monkeypatch, KeyError("step")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected KeyError" in err and "python -m launcher report" in err, err
    assert str(tmp_path / "traceback.txt") in err
    assert "KeyError: 'step'" in (tmp_path / "traceback.txt").read_text(encoding="utf-8")


def test_a_deeply_nested_json_state_file_is_one_line_in_a_real_process(tmp_path):
    """A workdir's JSON state nested past the interpreter's recursion limit, read by `doctor`."""
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "setup-state.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "launcher", "doctor", "--workdir", str(workdir), "--json"],
                            capture_output=True, text=True, encoding="utf-8")
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode in (0, 2), result.stderr[-2000:]
    if result.returncode == 0:
        json.loads(result.stdout)
    else:
        assert result.stderr.count("error:") == 1
