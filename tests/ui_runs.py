"""Fake run folders for the page's tests, the page's server on an ephemeral port, and a client."""

import json
import math
import threading
import zlib
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import yaml
from conftest import write_png
from png_bytes import IEND, chunk, ihdr, png

from launcher.envs.workdir import Workdir
from launcher.ui.guard import TOKEN_HEADER
from launcher.commands.ui import page_server
from launcher.ui.server import UiServer

STEPS = 100
ROWS = 30


def fake_run(runs: Path, name: str, rows: int = ROWS) -> Path:
    """A run folder as `run`, the watchdog and `sample` leave it: config, run.json, telemetry rows,
    watchdog decisions, a log and two prompts sampled at two strengths at step 20."""
    root = runs / name
    (root / name).mkdir(parents=True)
    process = {"type": "sd_trainer", "training_folder": str(root), "network": {"type": "lora", "linear": 32},
               "model": {"name_or_path": str(runs / "model"), "arch": "flux2", "qtype": "int4_fused"},
               "datasets": [{"folder_path": str(runs / "data"), "caption_ext": "txt", "resolution": [512]}],
               "train": {"steps": STEPS, "lr": 0.0001}}
    (root / "config.yaml").write_text(yaml.safe_dump({"job": "extension", "config": {"name": name, "process": [process]}}),
                                      encoding="utf-8")
    (root / name / "run.json").write_text(json.dumps({"preset": "7900xtx_512.yaml"}), encoding="utf-8")
    telemetry = [{"t": 1000.0 + 6 * step, "step": step, "loss": loss(step), "s_it": 38.0 if 10 <= step < 13 else 5.6,
                  "power_w": 240 if 10 <= step < 13 else 330, "vram_reserved_gib": 21.4, "host_rss_gib": 11.8}
                 for step in range(1, rows + 1)]
    lines = [json.dumps(row) for row in telemetry] + ["not a row", json.dumps({"step": "x", "loss": 1})]
    (root / "telemetry.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    events = [{"t": 1060.0, "step": 10, "kind": "stall", "reason": "power low and clock high held for 3 samples"},
              {"t": 1080.0, "step": 13, "kind": "restored", "reason": "rate back to 0.18 it/s"}]
    (root / "watchdog.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events), encoding="utf-8")
    log = "".join(f"step {step}: loss {row['loss']}\n" for step, row in enumerate(telemetry, 1))
    (root / "train.log").write_bytes(log.encode("utf-8"))  # bytes, as `run` copies them from the trainer
    for prompt in (0, 1):
        for strength in (0, 1):
            write_rgb_png(root / "samples" / "20" / f"p{prompt}_s{strength}.png", 64, (90 + 120 * strength, 110, 200 - 90 * prompt))
    write_png(root / "samples" / "20" / "contact_sheet.png", 128, 128)
    return root


def loss(step: int) -> float:
    """A loss that falls and wobbles as a real one does, the same on every run of the tests."""
    return round(0.32 + 0.25 * math.exp(-step / 25) + 0.03 * math.sin(step * 1.7), 4)


def write_rgb_png(path: Path, side: int, colour: tuple[int, int, int]) -> Path:
    """A square PNG shading from `colour` at the top to black, standing in for a sample."""
    rows = b"".join(b"\x00" + bytes(value * (side - y) // side for value in colour) * side for y in range(side))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png(ihdr(side, side, colour=2), chunk(b"IDAT", zlib.compress(rows)), IEND))
    return path


@contextmanager
def serving(workdir: Path):
    """The page's server for `workdir` on a free port of 127.0.0.1, stopped after the block."""
    server = page_server(Workdir(workdir), 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def request(server: UiServer, path: str, body: dict | None = None, token: str | None = "", headers: dict | None = None):
    """(status, content type, body bytes) of one request; `token=None` sends none, `""` the right one."""
    given = server.guard.token if token == "" else token
    sent = {TOKEN_HEADER: given, **(headers or {})}
    data = None
    if body is not None:
        data = json.dumps(body).encode("utf-8")
        sent = {"Content-Type": "application/json", "Origin": server.guard.origins[0], **sent}
    sent = {name: value for name, value in sent.items() if value is not None}  # None: that header is not sent
    url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=sent), timeout=120) as response:
            return response.status, response.headers.get("Content-Type"), response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type"), error.read()


def answer(server: UiServer, path: str, body: dict | None = None, **options):
    """The JSON of a request that must succeed."""
    status, _, data = request(server, path, body, **options)
    assert status == 200, (status, data)
    return json.loads(data)
