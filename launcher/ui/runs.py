"""What the page shows of the workdir's runs, read from the files `run` and the trainer write.

Every file is read through launcher/user_files.py without following a link below the runs folder:
a run folder may come from someone else (a shared run, a copied one), and the page must neither
read nor serve a file it only points at. Only images of a run are served as files; everything else
reaches the browser as JSON figures or log text.
"""

import json
import math
import re
import statistics
from pathlib import Path

from launcher.errors import LauncherError
from launcher.nofollow import is_link
from launcher.runs import run_lock
from launcher.runs.folders import RunFolder, check_runs_folder, find_run, read_run_config
from launcher.runs.telemetry import trainer_figures
from launcher.ui.guard import Refused
from launcher.user_files import UserFileError, last_rows, read_bytes, read_tail_lines, read_text

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}
PLOTTED = ("t", "step", "loss", "s_it", "power_w")
"""The figures of a telemetry row the plots draw (`launcher.in_trainer.plot` draws the same)."""
SUMMED = ("loss", "power_w", "vram_allocated_gib", "vram_reserved_gib", "host_rss_gib", "host_peak_rss_gib")
SAMPLE = re.compile(r"p(\d+)_s([-+0-9.e]+)\.png")
"""`sample`'s file names: prompt index and strength (overlay/toolkit/lora_sampler.py)."""
LOG_LINES = 80
SPEED_ROWS = 20
"""The newest rows whose median s/it gives the ETA: one slow step does not swing it."""


def runs(runs_dir: Path) -> list[Path]:
    """The run folders under `runs_dir` (each holds a config.yaml), newest config first; no link."""
    if not runs_dir.is_dir():
        return []
    check_runs_folder(runs_dir.parent, runs_dir)
    found = [path for path in runs_dir.iterdir()
             if not is_link(path) and (path / "config.yaml").is_file() and not is_link(path / "config.yaml")]
    return sorted(found, key=lambda path: (path / "config.yaml").stat().st_mtime, reverse=True)


def named(runs_dir: Path, name: str) -> RunFolder:
    """The run folder called `name` directly under `runs_dir`: a name from the page, never a path."""
    for root in runs(runs_dir):
        if root.name == name:
            return find_run(runs_dir, str(root))
    raise Refused(404, f"no run {name!r} in {runs_dir}")


def summary(runs_dir: Path, root: Path) -> dict:
    """One line of the run list: state, step, speed, ETA, loss, memory and the watchdog's last word."""
    try:
        run = find_run(runs_dir, str(root))
        steps = read_run_config(root)["config"]["process"][0]["train"]["steps"]
    except LauncherError as error:
        return {"name": root.name, "state": "unreadable", "error": str(error)}
    except (KeyError, IndexError, TypeError):
        return {"name": root.name, "state": "unreadable",
                "error": f"{root / 'config.yaml'} has no config.process[0].train.steps: is it a run config?"}
    rows = stepped(last_rows(run.telemetry, within=runs_dir))
    figures = rows[0] if rows else trainer_figures(stepped(last_rows(run.trainer_telemetry, within=runs_dir))) or {}
    step = figures.get("step")
    speeds = [row["s_it"] for row in rows[:SPEED_ROWS] if _number(row.get("s_it"))]
    s_it = statistics.median(speeds) if speeds else _number(figures.get("s_it"))
    training = run_lock.is_held(root) if (root / run_lock.INFO_FILE).is_file() else False
    left = steps - step if isinstance(steps, int) and _number(step) is not None else None
    return {
        "name": root.name,
        "job": run.name,
        "state": _state(training, step, steps),
        "step": step,
        "steps": steps,
        "eta_s": round(left * s_it) if training and left is not None and s_it else None,
        **{key: _number(figures.get(key)) for key in SUMMED},
        "s_it": s_it,
        "watchdog": watchdog_state(run, runs_dir),
    }


def stepped(rows: list[dict]) -> list[dict]:
    """The rows with a step that is a number: a damaged or hand-edited line is passed over."""
    return [row for row in rows if _number(row.get("step")) is not None]


def _state(training: bool, step, steps) -> str:
    if training:
        return "training"
    if step is None:
        return "not started"
    return "finished" if isinstance(steps, int) and step >= steps else f"stopped at step {step}"


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def watchdog_state(run: RunFolder, runs_dir: Path) -> str | None:
    """The stall watchdog's newest decision in words; that it gave up, once it has; None without one."""
    events = last_rows(run.watchdog_events, within=runs_dir)
    disabled = next((event for event in events if event.get("kind") == "disabled"), None)
    event = disabled or (events[0] if events else None)
    if event is None:
        return None
    return f"{event.get('kind')} at step {event.get('step')}: {event.get('reason', '')}".strip()


def detail(runs_dir: Path, name: str) -> dict:
    """A run's page: its summary, the rows of its plots, its watchdog events, samples and log tail."""
    run = named(runs_dir, name)
    return {**summary(runs_dir, run.root), "rows": plot_rows(run, runs_dir),
            "events": [{key: event.get(key) for key in ("step", "kind", "reason")}
                       for event in reversed(last_rows(run.watchdog_events, within=runs_dir))],
            "samples": samples(run), "log": log_tail(run, runs_dir)}


def plot_rows(run: RunFolder, runs_dir: Path) -> list[dict]:
    """The plotted figures of each telemetry row, oldest first; a row without a step, or a figure that
    is not a finite number (a damaged or hand-edited line), is left out."""
    try:
        text = read_text(run.telemetry, "history", within=runs_dir)
    except UserFileError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written, or the one the tail cut
        if isinstance(row, dict) and _number(row.get("step")) is not None:
            rows.append({key: row[key] for key in PLOTTED if _number(row.get(key)) is not None})
    return rows


def samples(run: RunFolder) -> list[dict]:
    """`sample`'s images per step folder: {step, images: [{prompt, strength, path}], sheet}; by step."""
    if not run.samples.is_dir() or is_link(run.samples):
        return []
    found = []
    for folder in run.samples.iterdir():
        if is_link(folder) or not folder.is_dir():
            continue
        images = []
        for image in folder.iterdir():
            match = SAMPLE.fullmatch(image.name)
            try:
                strength = float(match.group(2)) if match else None
            except ValueError:  # `p0_s1.2.3.png`: not a name `sample` writes
                strength = None
            if strength is not None and not is_link(image):
                images.append({"prompt": int(match.group(1)), "strength": strength,
                               "path": f"samples/{folder.name}/{image.name}"})
        sheet = folder / "contact_sheet.png"
        if images or sheet.is_file():
            found.append({"step": folder.name, "images": sorted(images, key=lambda i: (i["prompt"], i["strength"])),
                          "sheet": f"samples/{folder.name}/{sheet.name}" if sheet.is_file() else None})
    return sorted(found, key=lambda item: (not item["step"].isdigit(), int(item["step"]) if item["step"].isdigit() else 0))


def log_tail(run: RunFolder, runs_dir: Path) -> str:
    try:
        return read_tail_lines(run.log, LOG_LINES, within=runs_dir)
    except UserFileError as error:
        return "" if not (run.log.exists() or is_link(run.log)) else f"({error})"


def image(runs_dir: Path, name: str, relative: str) -> tuple[bytes, str]:
    """An image file of a run and its type: a plain relative path, no `..`, no link on the way."""
    parts = relative.split("/")
    if any(part in ("", ".", "..") or "\\" in part or ":" in part for part in parts):
        raise Refused(400, f"{relative!r} is not a plain path inside the run folder")
    kind = IMAGE_TYPES.get(Path(parts[-1]).suffix.lower())
    if kind is None:
        raise Refused(403, "only a run's images are served")
    root = named(runs_dir, name).root
    path = root.joinpath(*parts)
    if root.resolve() not in path.resolve().parents:
        raise Refused(403, f"{relative!r} leads out of the run folder")
    try:
        return read_bytes(path, "image", within=runs_dir), kind
    except UserFileError as error:
        raise Refused(404, str(error)) from None
