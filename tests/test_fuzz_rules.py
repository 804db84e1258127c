"""A fuzzer that holds the hostile-input rules: presets, datasets and run folders drawn from
generators, the launcher's commands run on them (dry runs, the stand-in trainer of test_run_guards,
stop, save, sample, comfy, report), and for every draw:

- the exit code is 0 or 2, and stderr holds no traceback;
- nothing is written outside the run folder and the workdir, and no file that was there changes;
- each command ends within a bound far outside run-to-run noise, and the process stays within a
  memory bound (a caption linked to /dev/zero or a string alias bomb would break both);
- no private text (the user's name in any case, a file behind a link) reaches a report.

Seeded (derandomized), FUZZ_EXAMPLES draws per property (default 40, which keeps the whole file
within a minute on two busy cores); FUZZ_EXAMPLES=500 for a longer search. A failure found here
becomes a named test in tests/test_hostile_rules.py.
"""

import contextlib
import hashlib
import io
import json
import os
import signal
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import write_png
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_comfy import NAME, lora_shapes, write_safetensors
from test_run_guards import StandIn

from launcher import field_report
from launcher.cli import main
from launcher.runs.presets import PRESETS_DIR

pytestmark = pytest.mark.skipif(os.name == "nt", reason="links, FIFOs and alarms as a POSIX user makes them")

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SECONDS_PER_COMMAND = 60
"""Each command takes well under a second here; a hang (a FIFO opened, a bomb expanded) takes forever."""
MEMORY_GROWTH = 1024 * 2**20
"""The most this process may grow by over one draw; /dev/zero read whole, or a bomb printed, exceeds it."""
PRIVATE = "alice"
TINY = yaml.safe_load((PRESETS_DIR / "tiny.yaml").read_text(encoding="utf-8"))


# -- invariants -----------------------------------------------------------------------------------


def snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple]:
    """Every entry under `root` (links not followed) with what it holds; entries under `skip` left out."""
    found = {}
    for folder, folders, files in os.walk(root):
        here = Path(folder)
        folders[:] = [name for name in folders if here / name not in skip]
        for name in folders + files:
            path = here / name
            if path in skip:
                continue
            found[str(path.relative_to(root))] = _state(path)
    return found


def _state(path: Path) -> tuple:
    if path.is_symlink():
        return ("link", os.readlink(path))
    if not path.is_file() or path.is_fifo():
        return ("folder" if path.is_dir() else "other",)
    with path.open("rb") as handle:  # a sparse 1 GiB file: its size and first bytes
        return ("file", path.stat().st_size, hashlib.sha256(handle.read(1 << 16)).hexdigest())


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class TimeBound(Exception):
    pass


@contextlib.contextmanager
def bounded():
    """The command's wall time bounded by SECONDS_PER_COMMAND (an alarm), its memory growth by MEMORY_GROWTH."""
    def expired(signum, frame):
        raise TimeBound(f"a command ran past {SECONDS_PER_COMMAND} s")
    before = peak_rss()
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(SECONDS_PER_COMMAND)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert peak_rss() - before < MEMORY_GROWTH, "a command grew the process by more than 1 GiB"


def launch(argv: list[str]) -> tuple[int, str]:
    """`python -m launcher ARGV` in this process, bounded: (exit code, stderr); never a traceback."""
    err, out = io.StringIO(), io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # run tees bytes to stdout.buffer
    with bounded(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    text = err.getvalue()
    assert code in (0, 2), (argv, code, text[-2000:])
    assert "Traceback" not in text, text[-2000:]
    if code == 2:
        assert text.count("error: ") == 1, text[-2000:]
    return code, text


# -- presets --------------------------------------------------------------------------------------


def leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*path, key))
    elif isinstance(node, list) and node:
        for index, value in enumerate(node):
            yield from leaves(value, (*path, index))
    yield path


PRESET_PATHS = [path for path in leaves(TINY) if path and path[0] in ("config", "launcher")]
HOSTILE_VALUES = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, -1, 2**31, 2**63, 10**20, 1e308, float("inf"), float("nan"), -0.0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.sampled_from(["", "\0", "../..", "/etc", "auto", "off", "x" * 5000]),
    st.none(), st.booleans(), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def set_at(data, path, value):
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


ALIASES = st.sampled_from([
    "bomb: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
    "s: &s " + "y" * 50_000 + "\nt: [" + ", ".join(["*s"] * 200) + "]\n",
    "k: 017\n", "k: 0x10\n", "k: 1:30\n", "config: {name: a}\nconfig: {name: b}\n", "k: !!python/object:os.system x\n",
    "k: [unclosed\n", "\t- tab\n", "",
])
ENCODINGS = st.sampled_from(["utf-8", "utf-16", "utf-16-le", "utf-8-sig", "latin-1"])


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(PRESET_PATHS), HOSTILE_VALUES), max_size=3),
       tail=ALIASES, encoding=ENCODINGS, dry=st.booleans())
def test_fuzz_presets(changes, tail, encoding, dry):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        runner = StandIn(root)
        data = json.loads(json.dumps(TINY))
        for path, value in changes:
            with contextlib.suppress(KeyError, IndexError, TypeError):
                set_at(data, path, value)
        try:
            text = yaml.safe_dump(data, allow_unicode=True) + tail
        except (yaml.YAMLError, ValueError):
            text = tail
        runner.preset.write_bytes(text.encode(encoding, errors="replace"))
        before = snapshot(root, skip=(runner.run_root,))
        launch(runner.args(*(["--dry-run"] if dry else [])))
        after = snapshot(root, skip=(runner.run_root,))
        assert {k: v for k, v in after.items() if k in before} == before, "a file that was there changed"
        new = sorted(set(after) - set(before))
        assert all(name.startswith("wd") for name in new), new


# -- datasets -------------------------------------------------------------------------------------


IMAGES = st.sampled_from(["png", "small", "junk", "truncated", "folder", "fifo", "dev-zero", "outside", "empty"])
CAPTIONS = st.sampled_from(["text", "utf-16", "utf-16-bom", "nul", "empty", "missing", "folder", "fifo",
                            "dev-zero", "outside", "huge", "latin-1", "long"])


def plant_image(path: Path, kind: str, outside: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind in ("png", "small"):
        write_png(path, 128 if kind == "png" else 8, 128 if kind == "png" else 8)
    elif kind == "junk":
        path.write_bytes(b"not an image at all")
    elif kind == "truncated":
        path.write_bytes(write_png(outside.parent / "whole.png", 128, 128).read_bytes()[:60])
    elif not plant_not_a_file(path, kind, outside):
        path.write_bytes(b"")


def plant_caption(path: Path, kind: str, outside: Path) -> None:
    writes = {"text": "a photo of sks".encode(), "utf-16": "a photo".encode("utf-16-le"),
              "utf-16-bom": "a photo".encode("utf-16"), "nul": b"a\0photo", "empty": b"",
              "latin-1": "caf\xe9".encode("latin-1"), "long": b"word " * 1000}
    if kind in writes:
        path.write_bytes(writes[kind])
    elif kind == "huge":
        with path.open("wb") as handle:
            handle.truncate(2**30)
    else:
        plant_not_a_file(path, kind, outside)


def plant_not_a_file(path: Path, kind: str, outside: Path) -> bool:
    """A folder, FIFO or link (to /dev/zero, or out of the dataset) in place of a file; False for other kinds."""
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "outside":
        path.symlink_to(outside)
    else:
        return False
    return True


@FUZZ
@given(files=st.lists(st.tuples(IMAGES, CAPTIONS, st.sampled_from(["", "sub/", "sub/deeper/", "_controls/"])),
                      min_size=1, max_size=5),
       skip_bad=st.booleans(), dry=st.booleans())
def test_fuzz_datasets(files, skip_bad, dry):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        runner = StandIn(root)
        runner.write_preset(skip_bad_images=skip_bad)
        outside = root / "outside.txt"
        outside.write_text(f"{PRIVATE}'s file outside the dataset")
        for index, (image, caption, folder) in enumerate(files):
            stem = runner.dataset / f"{folder}fuzz_{index}"
            plant_image(stem.with_suffix(".png"), image, outside)
            plant_caption(stem.with_suffix(".txt"), caption, outside)
        before = snapshot(root, skip=(runner.run_root,))
        launch(runner.args(*(["--dry-run"] if dry else [])))
        after = snapshot(root, skip=(runner.run_root,))
        assert {k: v for k, v in after.items() if k in before} == before, "a file that was there changed"


# -- run folders: stop, save, sample, comfy, report, and run into them ----------------------------


LAYOUTS = st.fixed_dictionaries({
    "runs": st.sampled_from(["folder", "link"]),
    "run": st.sampled_from(["folder", "link", "link-inside"]),
    "job": st.sampled_from(["folder", "file", "link", "missing", "user-files"]),
    "config": st.one_of(st.sampled_from(["good", "link", "fifo", "folder", "utf-16", "huge", "bomb"]),
                        st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                                     lambda inner: st.lists(inner, max_size=3)
                                     | st.dictionaries(st.sampled_from(["config", "name", "process", "model",
                                                                        "datasets", "sample", "name_or_path"]),
                                                       inner, max_size=3), max_leaves=8)),
    "log": st.sampled_from(["text", "huge", "link", "fifo", "missing"]),
    "telemetry": st.sampled_from(["text", "huge", "link", "fifo", "missing"]),
    "out": st.sampled_from(["fresh", "dangling-link", "file"]),
})
COMMANDS = st.lists(st.sampled_from(["stop", "save", "sample", "comfy", "report", "run"]), min_size=1, max_size=3)


def good_config(data: Path, model: Path) -> dict:
    return {"job": "extension", "config": {"name": NAME, "process": [{
        "type": "sd_trainer", "trigger_word": "sks", "network": {"type": "lora", "linear": 4},
        "model": {"name_or_path": str(model), "arch": "flux2"},
        "datasets": [{"folder_path": str(data), "caption_ext": "txt"}]}]}}


def plant_run(root: Path, layout: dict) -> tuple[Path, Path, Path]:
    """A workdir with one run laid out as `layout` says: (workdir, the folder outside it, --out)."""
    workdir, elsewhere = root / "wd", root / "elsewhere"
    workdir.mkdir()
    elsewhere.mkdir()
    (elsewhere / "private.txt").write_text(f"{PRIVATE} secret")
    data, model = root / "data", root / "model"
    write_png(data / "a.png", 64, 64).with_suffix(".txt").write_text(f"a photo of {PRIVATE.upper()}")
    from test_comfy import BASE

    write_safetensors(model / "flux2-dev.safetensors", BASE)
    runs = workdir / "runs" if layout["runs"] == "folder" else elsewhere / "runs"
    runs.mkdir(parents=True)
    if layout["runs"] == "link":
        (workdir / "runs").symlink_to(runs, target_is_directory=True)
    run = runs / NAME if layout["run"] == "folder" else (elsewhere if layout["run"] == "link" else runs) / "real"
    run.mkdir(parents=True, exist_ok=True)
    if layout["run"] != "folder":
        (runs / NAME).symlink_to(run, target_is_directory=True)
    plant_config(run / "config.yaml", layout["config"], good_config(data, model))
    job = run / NAME
    if layout["job"] in ("folder", "user-files"):
        write_safetensors(job / f"{NAME}.safetensors", lora_shapes())
        if layout["job"] == "user-files":
            (job / "run.json").write_text(f"{PRIVATE}'s own notes")
    elif layout["job"] == "file":
        job.write_text("a user's file")
    elif layout["job"] == "link":
        job.symlink_to(elsewhere, target_is_directory=True)
    plant_log(run / "train.log", layout["log"], elsewhere)
    plant_log(run / "trainer-telemetry.jsonl", layout["telemetry"], elsewhere)
    out = root / "report.zip"
    if layout["out"] == "dangling-link":
        out.symlink_to(elsewhere / "report.zip")
    elif layout["out"] == "file":
        out.write_bytes(b"a user's zip")
    return workdir, elsewhere, out


def plant_config(path: Path, kind, good: dict) -> None:
    if kind == "good":
        path.write_text(yaml.safe_dump(good))
    elif kind == "link":
        (path.parent.parent / "linked-config.yaml").write_text(yaml.safe_dump(good))
        path.symlink_to(path.parent.parent / "linked-config.yaml")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "utf-16":
        path.write_bytes(yaml.safe_dump(good).encode("utf-16-le"))
    elif kind == "huge":
        with path.open("wb") as handle:
            handle.truncate(2**30)
    elif kind == "bomb":
        path.write_text("config: {name: " + NAME + "}\ns: &s " + "z" * 100_000 + "\nt: [" + ", ".join(["*s"] * 100) + "]\n")
    else:
        path.write_text(yaml.safe_dump(kind))


def plant_log(path: Path, kind: str, elsewhere: Path) -> None:
    if kind == "text":
        path.write_text(f"step 1 by {PRIVATE.capitalize()} in /home/{PRIVATE}-backup\n")
    elif kind == "huge":
        with path.open("wb") as handle:
            handle.seek(2**30)
            handle.write(f"\nlast line by {PRIVATE.upper()}_x\n".encode())
    elif kind == "link":
        path.symlink_to(elsewhere / "private.txt")
    elif kind == "fifo":
        os.mkfifo(path)


def argv(command: str, workdir: Path, out: Path, root: Path) -> list[str]:
    if command == "report":
        return ["report", "--workdir", str(workdir), "--no-selftest", "--out", str(out)]
    if command == "run":
        return ["run", "tiny", "--workdir", str(workdir), "--dry-run", "--output", str(root / "wd" / "out")]
    return [command, "--workdir", str(workdir)]


@FUZZ
@given(layout=LAYOUTS, commands=COMMANDS)
def test_fuzz_run_folders(layout, commands):
    with tempfile.TemporaryDirectory() as scratch, pytest.MonkeyPatch.context() as patch:
        root = Path(scratch)
        patch.setenv("HOME", f"/home/{PRIVATE}")
        patch.setattr(field_report, "_user", lambda: PRIVATE)
        workdir, elsewhere, out = plant_run(root, layout)
        outside = snapshot(root, skip=(workdir, out))
        inside = snapshot(workdir)
        for command in commands:
            code, _ = launch(argv(command, workdir, out, root))
            if command == "report" and code == 0:
                check_report(out)
                out.unlink()
        assert snapshot(root, skip=(workdir, out)) == outside, "written outside the workdir"
        now = snapshot(workdir)
        assert {k: v for k, v in now.items() if k in inside} == inside, "a file that was there changed"


def check_report(out: Path) -> None:
    with zipfile.ZipFile(out) as archive:
        for name in archive.namelist():
            text = archive.read(name)
            assert PRIVATE not in name.lower() and PRIVATE.encode() not in text.lower(), (name, text[:200])
            assert len(text) <= field_report.MEMBER_BYTES + 100, name
