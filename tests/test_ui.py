"""`ui`: the page's server, with a real server on an ephemeral port and urllib as the browser.

What it shows of fake run folders, the files it serves and refuses, the token, host and origin
checks, save/stop through the commands' own function, and a run started from the page with the
stand-in trainer of test_run_guards.py.
"""

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from test_run_guards import StandIn
from ui_runs import answer, fake_run, loss, request, serving

from flux2_contract.files import SAVE_NOW, STOP_NOW
from launcher.cli import main
from launcher.envs.workdir import Workdir
from launcher.runs.presets import read_preset
from launcher.runs.run_lock import run_folder_lock
from launcher.runs.schema import check_preset
from launcher.step_prediction import load_table
from launcher.ui import new_run
from launcher.ui.guard import TOKEN_HEADER

GUARD_S = 120


@pytest.fixture
def workdir(tmp_path) -> Path:
    fake_run(tmp_path / "wd" / "runs", "sks_dog")
    return tmp_path / "wd"


def wait_for_job(server, job: str) -> dict:
    deadline = time.monotonic() + GUARD_S
    while True:
        state = answer(server, f"/api/jobs/{job}")
        if state["done"]:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.1)


# -- what it shows ------------------------------------------------------------------------------


def test_the_run_list_shows_state_speed_eta_memory_and_the_watchdog(workdir):
    root = workdir / "runs" / "sks_dog"
    with serving(workdir) as server:
        [stopped] = answer(server, "/api/runs")
        with run_folder_lock(root):  # as `run` holds it while its trainer lives
            [training] = answer(server, "/api/runs")
    assert stopped["state"] == "stopped at step 30" and stopped["eta_s"] is None
    assert training["state"] == "training"
    assert training["step"] == 30 and training["steps"] == 100
    assert training["s_it"] == 5.6  # the median of the newest rows: the stall's 38 s/it do not swing it
    assert training["eta_s"] == round(70 * 5.6)
    assert training["loss"] == loss(30) and training["vram_reserved_gib"] == 21.4
    assert training["host_rss_gib"] == 11.8
    assert training["watchdog"].startswith("restored at step 13")


def test_a_run_page_has_its_rows_events_samples_and_log(workdir):
    with serving(workdir) as server:
        run = answer(server, "/api/runs/sks_dog")
    assert [row["step"] for row in run["rows"]] == list(range(1, 31))  # the damaged lines are left out
    assert run["rows"][9] == {"t": 1060.0, "step": 10, "loss": loss(10), "s_it": 38.0, "power_w": 240}
    assert [event["kind"] for event in run["events"]] == ["stall", "restored"]
    [step] = run["samples"]
    assert step["step"] == "20" and step["sheet"] == "samples/20/contact_sheet.png"
    assert [(image["prompt"], image["strength"]) for image in step["images"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert run["log"].endswith(f"step 30: loss {loss(30)}\n")


def test_a_damaged_config_is_named_in_the_list(workdir):
    (workdir / "runs" / "broken").mkdir()
    (workdir / "runs" / "broken" / "config.yaml").write_text("config: [1, 2\n", encoding="utf-8")
    with serving(workdir) as server:
        listed = {run["name"]: run for run in answer(server, "/api/runs")}
    assert listed["broken"]["state"] == "unreadable" and "config.yaml" in listed["broken"]["error"]
    assert listed["sks_dog"]["step"] == 30


# -- files --------------------------------------------------------------------------------------


def test_a_runs_image_is_served(workdir):
    with serving(workdir) as server:
        status, kind, data = request(server, "/files/sks_dog/samples/20/p0_s1.png")
    assert status == 200 and kind == "image/png"
    assert data == (workdir / "runs" / "sks_dog" / "samples" / "20" / "p0_s1.png").read_bytes()


@pytest.mark.parametrize("path, status", [
    ("/files/sks_dog/config.yaml", 403),  # not an image
    ("/files/sks_dog/samples/../../other/secret.png", 400),
    ("/files/sks_dog/samples/%2e%2e/%2e%2e/other/secret.png", 400),
    ("/files/sks_dog/..%5C..%5Cother%5Csecret.png", 400),
    ("/files/..%2Fother/secret.png", 404),  # not a run of the workdir
    ("/files/sks_dog/samples/20/missing.png", 404),
])
def test_paths_out_of_a_run_or_not_its_images_are_refused(workdir, path, status):
    write_png_outside = workdir / "other" / "secret.png"
    write_png_outside.parent.mkdir()
    write_png_outside.write_bytes(b"\x89PNG secret")
    with serving(workdir) as server:
        got, _, data = request(server, path)
    assert got == status and b"secret" not in data.replace(b"secret.png", b"")


@pytest.mark.skipif(os.name == "nt", reason="links need Developer Mode on Windows")
def test_a_link_in_a_run_folder_is_not_followed(workdir, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"\x89PNG the secret")
    (workdir / "runs" / "sks_dog" / "samples" / "20" / "leak.png").symlink_to(secret)
    (workdir / "runs" / "sks_dog" / "samples" / "linked").symlink_to(secret.parent)
    (workdir / "runs" / "sks_dog" / "samples" / "20" / "alias.png").symlink_to("p0_s0.png")  # inside, still a link
    with serving(workdir) as server:
        inside, _, why = request(server, "/files/sks_dog/samples/20/alias.png")
        status, _, data = request(server, "/files/sks_dog/samples/20/leak.png")
        linked, _, through = request(server, "/files/sks_dog/samples/linked/secret.png")
        listed = answer(server, "/api/runs/sks_dog")["samples"]
    assert status == 403 and b"the secret" not in data
    assert inside == 404 and b"is a link" in why
    assert linked == 403 and b"leads out of the run folder" in through
    assert [step["step"] for step in listed] == ["20"]


# -- who may ask --------------------------------------------------------------------------------


def test_the_server_listens_on_loopback_only(workdir):
    with serving(workdir) as server:
        assert server.server_address[0] == "127.0.0.1"
        assert server.url.startswith(f"http://127.0.0.1:{server.server_address[1]}/?token=")
        assert len(server.guard.token) >= 40


@pytest.mark.parametrize("token", [None, "wrong", "x" * 43])
def test_every_request_needs_the_token(workdir, token):
    with serving(workdir) as server:
        for path in ("/", "/static/ui.js", "/api/runs", "/files/sks_dog/samples/20/p0_s1.png"):
            status, _, data = request(server, path, token=token)
            assert status == 403 and b"token" in data, path


def test_the_token_in_the_query_opens_the_page(workdir):
    with serving(workdir) as server:
        status, kind, page = request(server, f"/?token={server.guard.token}", token=None)
    assert status == 200 and kind.startswith("text/html")
    assert f"ui.js?token={server.guard.token}".encode() in page


@pytest.mark.parametrize("headers, words", [
    ({"Host": "evil.example:80"}, b"Host"),  # a DNS-rebinding page
    ({"Sec-Fetch-Site": "cross-site"}, b"another site"),
    ({"Origin": "http://evil.example"}, b"origin"),
    ({"Origin": "null"}, b"origin"),
])
def test_a_request_from_another_site_is_refused(workdir, headers, words):
    with serving(workdir) as server:
        for path, body in (("/api/runs", None), ("/api/flag/stop", {"run": "sks_dog"})):
            status, _, data = request(server, path, body, headers=headers)
            assert status == 403 and words in data, (path, data)
    assert not (workdir / "runs" / "sks_dog" / "sks_dog" / STOP_NOW).exists()


def test_an_action_is_a_json_post_from_the_page(workdir):
    with serving(workdir) as server:
        get, _, _ = request(server, "/api/flag/stop")
        form, _, _ = request(server, "/api/flag/stop", {"run": "sks_dog"}, headers={"Content-Type": "text/plain"})
        bare, _, _ = request(server, "/api/flag/stop", {"run": "sks_dog"}, headers={"Origin": None})
    assert (get, form) == (404, 415)
    assert bare == 403  # neither Origin nor Sec-Fetch-Site: not a browser page's request
    assert not (workdir / "runs" / "sks_dog" / "sks_dog" / STOP_NOW).exists()


# -- actions ------------------------------------------------------------------------------------


def test_save_and_stop_write_the_flag_files(workdir):
    job = workdir / "runs" / "sks_dog" / "sks_dog"
    with serving(workdir) as server:
        saved = answer(server, "/api/flag/save", {"run": "sks_dog"})
        assert job.joinpath(SAVE_NOW).is_file() and not job.joinpath(STOP_NOW).exists()
        answer(server, "/api/flag/stop", {"run": "sks_dog"})
    assert job.joinpath(STOP_NOW).is_file()
    assert str(job / SAVE_NOW) in saved["message"]


def test_a_flag_for_a_path_instead_of_a_run_name_is_refused(workdir, tmp_path):
    elsewhere = fake_run(tmp_path / "elsewhere", "other")
    with serving(workdir) as server:
        status, _, data = request(server, "/api/flag/stop", {"run": str(elsewhere)})
    assert status == 404 and b"no run" in data
    assert not (elsewhere / "other" / STOP_NOW).exists()


def test_comfy_runs_as_the_command_and_its_output_is_shown(workdir):
    with serving(workdir) as server:
        job = answer(server, "/api/command/comfy", {"run": "sks_dog"})["job"]
        state = wait_for_job(server, job)
    assert state["exit_code"] == 2
    assert "has no saved LoRA yet" in state["output"]
    assert state["command"].startswith("-m launcher comfy ")


def test_report_runs_as_the_command_and_names_its_zip(workdir):
    with serving(workdir) as server:
        state = wait_for_job(server, answer(server, "/api/command/report", {})["job"])
    assert state["exit_code"] == 0, state["output"]
    [zip_file] = (workdir / "ui" / "reports").glob("flux2-report-*.zip")
    assert f"wrote {zip_file}" in state["output"]
    assert "--no-selftest" in state["command"]


# -- a new run ----------------------------------------------------------------------------------


def test_a_preset_is_shown_with_the_file_that_set_each_value(workdir):
    with serving(workdir) as server:
        assert "7900xtx_512" in answer(server, "/api/presets")
        preset = answer(server, "/api/presets/7900xtx_512")
        refused, _, _ = request(server, "/api/presets/..%2Fpyproject")
    assert preset["values"]["steps"] == "2000" and preset["values"]["resolution"] == "512"
    assert any("steps: 2000" in line and "# base_512.yaml:" in line for line in preset["lines"])
    assert refused == 404


@pytest.mark.parametrize("field, value", [("steps", "0"), ("lr", "fast"), ("resolution", "500"), ("name", "a/b")])
def test_a_bad_value_gets_the_schemas_message_and_nothing_is_written(workdir, field, value):
    with serving(workdir) as server:
        result = answer(server, "/api/check", {"preset": "7900xtx_512", "values": {field: value}})
    assert result["ok"] is False
    if field != "name":
        data = read_preset("7900xtx_512").data
        key = {"steps": ("train", "steps"), "lr": ("train", "lr"), "resolution": ("datasets", 0, "resolution")}[field]
        node = data["config"]["process"][0]
        for part in key[:-1]:
            node = node[part]
        node[key[-1]] = [int(value)] if field == "resolution" else int(value) if value.isdigit() else value
        [expected] = check_preset(data)
        assert expected in result["error"]
    assert "nothing was started" in result["error"] or "plain folder name" in result["error"]
    assert not (workdir / "ui" / "presets").exists()


def test_start_before_a_passing_check_is_refused(workdir):
    with serving(workdir) as server:
        status, _, data = request(server, "/api/start", {"start": "7900xtx_512.yaml"})
    assert status == 409 and b"check the settings first" in data


def test_a_run_started_from_the_page_trains_the_edited_preset(tmp_path):
    stand_in = StandIn(tmp_path)
    values = {"name": "page_run", "steps": "3", "rank": "8", "trigger_word": "sks", "prompts": "a sks dog\na sks cat"}
    with serving(stand_in.workdir.root) as server:
        checked = answer(server, "/api/check", {"preset": "tiny", "values": values})
        assert checked["ok"], checked
        assert "--dry-run" in checked["command"] and "steps: 3" in checked["output"]
        assert checked["eta"].startswith("no ETA before the run: no self-test")
        started = answer(server, "/api/start", {"start": checked["start"]})
        state = wait_for_job(server, started["job"])
        listed = answer(server, "/api/runs")
    assert state["exit_code"] == 0, state["output"]
    assert "the trainer finished (exit code 0)" in state["output"]
    preset = stand_in.workdir.root / "ui" / "presets" / "page_run.yaml"
    written = yaml.safe_load(preset.read_text(encoding="utf-8"))
    assert written["inherits"].endswith("tiny.yaml")
    process = written["config"]["process"][0]
    assert process["train"] == {"steps": 3} and process["network"] == {"linear": 8, "linear_alpha": 8}
    assert process["sample"] == {"prompts": ["a sks dog", "a sks cat"]} and process["trigger_word"] == "sks"
    config = yaml.safe_load((stand_in.workdir.runs / "page_run" / "config.yaml").read_text(encoding="utf-8"))
    assert config["config"]["process"][0]["train"]["steps"] == 3
    assert json.loads((stand_in.workdir.runs / "page_run" / "page_run" / "run.json").read_text())["preset"] == str(preset)
    assert [run["name"] for run in listed] == ["page_run"]
    assert main(["presets", str(preset)]) == 0  # the written preset is an ordinary one


def test_the_token_header_name_is_what_the_page_sends():
    script = (Path(__file__).resolve().parents[1] / "launcher" / "ui" / "static" / "ui.js").read_text(encoding="utf-8")
    assert f'"{TOKEN_HEADER}": token' in script


def test_the_dry_runs_plan_and_config_are_read_from_its_output():
    output = ("# qtype: auto -> int4_fused (the self-test passed it)\n# memory plan: 12 of 56 blocks streamed\n"
              "disk: the quantized cache: complete, 0.0 GiB still to write\n"
              "job: extension\nconfig:\n  name: sks\n  process:\n  - train: {steps: 2000}\n"
              "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True\nTRITON_CACHE_AUTOTUNING=1\n")
    plan, config = new_run.read_dry_run(output)
    assert plan == ["qtype: auto -> int4_fused (the self-test passed it)", "memory plan: 12 of 56 blocks streamed",
                    "disk: the quantized cache: complete, 0.0 GiB still to write"]
    assert config == {"job": "extension", "config": {"name": "sks", "process": [{"train": {"steps": 2000}}]}}


def test_the_eta_before_a_run_comes_from_the_prediction_of_the_self_tested_card(tmp_path):
    workdir = Workdir(tmp_path)
    process = {"train": {"steps": 2000}, "datasets": [{"resolution": [512]}],
               "model": {"arch": "flux2", "qtype": "int4_fused", "model_kwargs": {"compile_blocks": True}}}
    config = {"config": {"process": [process]}}
    assert new_run.eta(workdir, config).startswith("no ETA before the run: no self-test")
    workdir.selftest.write_text(json.dumps({"environment": {"gpu": {"name": "AMD Radeon RX 7900 XTX"}}}))
    [row] = [row for row in load_table() if (row.card, row.path, row.px, row.compiled, row.model)
             == ("RX 7900 XTX", "int4_fused", 512, True, "flux2")]
    fast, slow = row.range_s
    said = new_run.eta(workdir, config)
    assert said.startswith(f"ETA {new_run.hours(2000 * fast)} to {new_run.hours(2000 * slow)} for 2000 steps")
    assert "RX 7900 XTX (int4_fused, 512 px, compiled" in said
    process["model"]["qtype"] = "float8"
    assert new_run.eta(workdir, config).startswith("no ETA before the run: the step prediction has no row")
