"""`ui` in a real browser: Debian's Chromium, headless, driven over its DevTools protocol.

The page loads, a run's plots and samples appear, save and stop write their flag files, a bad
value shows the preset schema's message, and a page of another origin cannot stop a run. Without
Chromium the tests skip with the reason, except in CI (CI=true), where they fail
(.ci/browser.sh installs it); under Wine (.ci/windows.sh) they skip: the Linux run drives the
browser. LAUNCHER_UI_SCREENSHOT=docs/ui.png writes the run page's screenshot there too (the one
docs/ui.md shows).
"""

import json
import os
from pathlib import Path

import pytest
from conftest import UNDER_WINE, in_ci
from headless import Browser, find_chromium
from ui_runs import fake_run, serving

from flux2_contract.files import SAVE_NOW, STOP_NOW
from launcher.runs.presets import read_preset
from launcher.runs.run_lock import run_folder_lock
from launcher.runs.schema import check_preset

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if UNDER_WINE:
        pytest.skip("the Linux run of the tests drives Chromium; under Wine there is none to drive")
    chromium = find_chromium()
    if chromium is None:
        reason = "no chromium on PATH (Debian: apt-get install chromium; or set CHROMIUM)"
        if in_ci():
            pytest.fail(f"{reason}; under CI=true the page's browser tests must run (.ci/browser.sh installs it)",
                        pytrace=False)
        pytest.skip(reason)
    running = Browser(chromium, tmp_path_factory.mktemp("chromium") / "profile")
    yield running
    running.close()


@pytest.fixture
def workdir(tmp_path) -> Path:
    fake_run(tmp_path / "wd" / "runs", "sks_dog", rows=80)
    return tmp_path / "wd"


def test_a_run_page_shows_plots_samples_and_log_and_its_buttons_write_the_flags(browser, workdir, tmp_path):
    root = workdir / "runs" / "sks_dog"
    page = browser.page()
    with serving(workdir) as server, run_folder_lock(root):
        page.go(server.url)
        assert "training" in page.wait_for("document.querySelector('#runs tr[data-run=\"sks_dog\"]')?.textContent")
        page.evaluate("document.querySelector('a[href=\"#run/sks_dog\"]').click()")
        points = page.wait_for("document.querySelector('#plot-loss polyline.series')?.getAttribute('points')")
        assert len(points.split()) == 80
        assert page.wait_for("document.querySelectorAll('#plot-s_it line').length") == 2  # stall, restored
        assert page.wait_for("document.querySelector('#plot-power_w polyline.series') !== null")
        loaded = "[...document.querySelectorAll('#samples img')].filter(i => i.complete && i.naturalWidth === 64).length"
        assert page.wait_for(f"{loaded} === 4 && {loaded}")
        assert "step 80: loss" in page.evaluate("document.getElementById('log').textContent")
        assert "ETA" in page.evaluate("document.getElementById('run-state').textContent")
        shot = page.screenshot(1280, 1100)
        for action, flag in (("save", SAVE_NOW), ("stop", STOP_NOW)):
            page.evaluate("document.getElementById('action-message').textContent = ''")
            page.evaluate(f"document.getElementById('{action}').click()")
            assert flag in page.wait_for("document.getElementById('action-message').textContent")
            assert (root / "sks_dog" / flag).is_file()
    assert shot.startswith(PNG)
    (tmp_path / "ui.png").write_bytes(shot)
    if os.environ.get("LAUNCHER_UI_SCREENSHOT"):
        Path(os.environ["LAUNCHER_UI_SCREENSHOT"]).write_bytes(shot)


def test_a_bad_value_shows_the_schemas_message(browser, workdir):
    data = read_preset("7900xtx_512").data
    data["config"]["process"][0]["train"]["steps"] = 0
    [expected] = check_preset(data)
    page = browser.page()
    with serving(workdir) as server:
        page.go(server.url + "#new")
        assert page.wait_for("document.querySelector('input[name=steps]')?.value") == "2000"
        assert "# base_512.yaml:" in page.evaluate("document.getElementById('preset-lines').textContent")
        page.evaluate("document.querySelector('input[name=steps]').value = '0'; document.getElementById('check').click()")
        message = page.wait_for("!document.getElementById('check-error').hidden && "
                                "document.getElementById('check-error').textContent")
    assert expected in message and "nothing was started" in message
    assert page.evaluate("document.getElementById('plan').hidden") is True
    assert not (workdir / "ui" / "presets").exists()


def test_a_page_of_another_origin_cannot_stop_a_run(browser, workdir):
    """Even with the token (a leaked URL), a request from another page is refused or never sent."""
    page = browser.page()
    with serving(workdir) as server:
        page.go("data:text/html,<p>another site</p>")
        page.wait_for("document.body?.textContent === 'another site'")
        target = json.dumps(f"http://127.0.0.1:{server.server_address[1]}/api/flag/stop?token={server.guard.token}")
        body = json.dumps(json.dumps({"run": "sks_dog"}))
        for options in ("{method: 'POST', mode: 'no-cors', headers: {'Content-Type': 'text/plain'}, body: %s}" % body,
                        "{method: 'POST', headers: {'Content-Type': 'application/json'}, body: %s}" % body):
            page.evaluate(f"fetch({target}, {options}).then(r => r.status, e => String(e))")
        read = page.evaluate(f"fetch({target.replace('/api/flag/stop', '/api/runs')}).then(r => r.text(), e => 'blocked')")
    assert read == "blocked"
    assert not (workdir / "runs" / "sks_dog" / "sks_dog" / STOP_NOW).exists()
