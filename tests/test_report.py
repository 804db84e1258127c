"""`report`: one zip for a bug report, with the machine's paths and names scrubbed."""

import getpass
import json
import urllib.parse
import zipfile
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.field_report import Scrubber


def fake_run(runs: Path, name: str, log: str) -> Path:
    root = runs / name
    (root / name).mkdir(parents=True)
    (root / "config.yaml").write_text(f"config:\n  name: {name}\n", encoding="utf-8")
    (root / name / "run.json").write_text(json.dumps({"preset": "7900xtx_512.yaml"}), encoding="utf-8")
    (root / "train.log").write_bytes(log.encode("utf-8"))  # bytes, as the launcher copies them from the trainer
    return root


def read_zip(path: Path) -> dict[str, str]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name).decode("utf-8") for name in archive.namelist()}


def test_the_report_carries_doctor_and_recent_runs_with_paths_scrubbed(tmp_path, capsys):
    workdir = tmp_path / "wd"
    user = getpass.getuser()
    log = "".join(f"step {i}\n" for i in range(400)) + f"loaded {workdir}/cache/x from {Path.home()} by user {user}\n"
    fake_run(workdir / "runs", "my_lora", log)
    out = tmp_path / "report.zip"
    assert main(["report", "--workdir", str(workdir), "--no-selftest", "--out", str(out)]) == 0
    files = read_zip(out)
    assert {"doctor.json", "MANIFEST.txt", "runs/0-my_lora/run.json", "runs/0-my_lora/train.log.tail"} <= set(files)
    tail = files["runs/0-my_lora/train.log.tail"]
    assert "step 99\n" not in tail and "step 399\n" in tail  # the last lines only
    assert "loaded <workdir>/cache/x from <home> by user <user>" in tail
    for name, text in files.items():
        assert str(workdir) not in text and str(Path.home()) + "/" not in text, name
    assert json.loads(files["doctor.json"])["workdir"] == "<workdir>"
    assert "wrote" in capsys.readouterr().out


def test_an_existing_file_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "report.zip"
    out.write_bytes(b"the user's file")
    assert main(["report", "--workdir", str(tmp_path / "wd"), "--no-selftest", "--out", str(out)]) == 2
    assert out.read_bytes() == b"the user's file"
    assert "never overwritten" in capsys.readouterr().err


def test_a_radeon_run_is_placed_against_the_predicted_range(tmp_path, capsys, monkeypatch):
    """On a card the prediction covers, the zip carries the predicted ranges and the run's s/it against its row."""
    import launcher.commands.report as report_command
    from launcher.checkup import collect

    def doctor_on_a_7900xtx(workdir):
        found = collect(workdir)
        found["torch"] = {"torch": "2.13.0+rocm10.0.0", "hip": "7.2", "gpus": [{"name": "AMD Radeon RX 7900 XTX"}]}
        return found

    monkeypatch.setattr(report_command, "collect", doctor_on_a_7900xtx)
    root = fake_run(tmp_path / "wd" / "runs", "xtx", "step 1\n")
    process = {"model": {"qtype": "int4_fused", "model_kwargs": {"compile_blocks": True}}, "datasets": [{"resolution": [512]}]}
    (root / "config.yaml").write_text(json.dumps({"config": {"name": "xtx", "process": [process]}}), encoding="utf-8")
    (root / "trainer-telemetry.jsonl").write_text(json.dumps({"step": 3, "s_per_it": 7.0}) + "\n", encoding="utf-8")
    out = tmp_path / "report.zip"
    assert main(["report", "--workdir", str(tmp_path / "wd"), "--no-selftest", "--out", str(out)]) == 0
    prediction = json.loads(read_zip(out)["prediction.json"])
    assert {"path": "int4_fused", "px": 512, "compiled": True} in [
        {key: row[key] for key in ("path", "px", "compiled")} for row in prediction["predicted"]]
    verdict = prediction["runs"][0]["verdict"]
    assert verdict.startswith("7.00 s/it: inside the predicted") and "TFLOP/s" in verdict
    assert f"xtx: {verdict}" in capsys.readouterr().out


def test_a_short_user_name_does_not_scrub_words():
    scrub = Scrubber({"/home/al": "<home>", "al": "<user>"})
    assert scrub("/home/al/x and al, but also alpha and total") == "<home>/x and <user>, but also alpha and total"


@pytest.mark.trainer
def test_the_report_times_the_tiny_model_on_this_machine(trainer_workdir, tmp_path):
    out = tmp_path / "report.zip"
    assert main(["report", "--workdir", str(trainer_workdir.root), "--no-selftest", "--out", str(out)]) == 0
    files = read_zip(out)
    tiny = json.loads(files["tiny.json"])
    assert tiny["exit_code"] == 0 and tiny["seconds"] > 0, files["tiny.log"][-3000:]
    assert "tiny/run.json" in files and "tiny/train.log.tail" in files
    assert json.loads(files["doctor.json"])["torch"]["torch"]
    assert str(trainer_workdir.root.resolve()) not in "".join(files.values())


WINDOWS_HOME = "C:\\Users\\Zoë Müller"
WINDOWS_WORKDIR = WINDOWS_HOME + "\\данные_日本\\.aitk"


@pytest.mark.parametrize("write", [
    lambda text: text,
    lambda text: json.dumps({"path": text}),  # backslashes doubled, letters outside ASCII as \u00eb
    lambda text: json.dumps({"path": text}, ensure_ascii=False),
    lambda text: json.dumps({"path": text.replace("\\", "/")}),
    lambda text: "file:///" + urllib.parse.quote(text.replace("\\", "/"), safe="/:"),
    lambda text: urllib.parse.quote(text, safe=""),
], ids=["plain", "json", "json-utf8", "json-slashes", "file-url", "url-encoded"])
def test_windows_paths_and_names_are_scrubbed_in_every_spelling_a_member_holds(write):
    scrub = Scrubber({WINDOWS_WORKDIR: "<workdir>", WINDOWS_HOME: "<home>", "Zoë Müller": "<user>", "ZOE-PC": "<host>"})
    text = scrub(write(WINDOWS_WORKDIR + "\\runs\\x") + " " + write(WINDOWS_HOME + "\\Downloads") + " "
                 + write("Zoë Müller") + " on " + write("zoe-pc"))
    for leak in ("Zo", "ller", "данные", "\\u0434", "%D0", "日本", "zoe-pc"):
        assert leak not in text, (leak, text)
    assert "<workdir>" in text and "<home>" in text and "<user>" in text and "<host>" in text


def test_a_report_of_a_non_ascii_workdir_holds_no_spelling_of_it(tmp_path, capsys):
    workdir = tmp_path / "Zoë_данные" / "wd"
    fake_run(workdir / "runs", "my_lora", f"loaded {workdir}/cache\n")
    metadata = next((workdir / "runs" / "my_lora").glob("*/run.json"))
    metadata.write_text(json.dumps({"preset": str(workdir / "p.yaml"), "dataset": [str(workdir / "d")]}), encoding="utf-8")
    out = tmp_path / "report.zip"
    assert main(["report", "--workdir", str(workdir), "--no-selftest", "--out", str(out)]) == 0
    for name, text in read_zip(out).items():
        assert "Zo" not in text and "данные" not in text and "\\u0434" not in text, (name, text[:2000])
