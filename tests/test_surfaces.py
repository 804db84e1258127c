"""The surface matrix: every file a command touches, damaged one way at a time (tests/surfaces.py).

Each documented invocation runs once in this process under the audit hook; the paths it touched
inside its tree are its surfaces. Each cell then copies the invocation's pristine tree, makes one
surface hostile and runs the command in a child process, and holds the rules for every input:

- exit 0 or 2, within SECONDS, within MEMORY (a 1 GiB address-space limit: a read of /dev/zero
  ends in the out-of-memory line, which fails the cell too);
- no traceback, no line of the error boundary's "unexpected" kind (a bug), at most one `error:`
  line, and that line names the damaged file or a folder above it;
- nothing changed outside the tree, nothing in the tree that the undamaged run does not change,
  and a user's file planted where the command writes keeps its bytes;
- SECRET (held by every file a planted link leads to, and planted in files and folders) is quoted by
  no error or warning (they name files, never show their content) and reaches no archive (a report
  follows no link and gathers no stray file; only the `secret` cell of a file it holds by design,
  a run's log, puts it there).

CI runs a fixed sample (each invocation with each of its mutations once, the surface drawn with a
fixed seed); LAUNCHER_FULL_MATRIX=1 runs every cell.
"""

import contextlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import write_png
from surfaces import (
    NEEDS_A_USER,
    SECRET,
    Invocation,
    Outcome,
    changed,
    copy_tree,
    mutate,
    mutations,
    recording,
    restore_permissions,
    role,
    run_cell,
    snapshot,
    surfaces,
)
from test_comfy import BASE, lora_shapes, write_safetensors
from test_run import fake_safetensors
from test_run_guards import StandIn

from launcher.cli import main
from launcher.envs.workdir import venv_python
from launcher.runs import disk_budget
from launcher.runs.presets import PRESETS_DIR

pytestmark = pytest.mark.skipif(os.name == "nt", reason="links, FIFOs and rlimits as a POSIX user makes them")

FULL = os.environ.get("LAUNCHER_FULL_MATRIX") == "1"
SEED = 20260101
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
RUN = "tiny_flux2"


# -- the trees the invocations run in -------------------------------------------------------------


def stand_in_tree(tree: Path) -> StandIn:
    """test_run_guards' workdir: a stand-in trainer, the tiny dataset, and a venv whose python runs the
    trainer's run.py with this interpreter and fails a module (`-m`: tiny assets, plot, sample) in one
    line, as a venv without torch does (its traceback would be the child's, not the launcher's)."""
    runner = StandIn(tree)
    python = venv_python(runner.workdir.venv)
    python.unlink()
    python.write_text(f'#!/bin/sh\nif [ "$1" = -m ]; then echo "this venv has no torch" >&2; exit 1; fi\n'
                      f'exec "{sys.executable}" "$@"\n', encoding="utf-8")
    python.chmod(0o755)
    return runner


def finished_run_tree(tree: Path) -> None:
    """A stand-in workdir after one finished run of the tiny preset, with a LoRA, a base checkpoint,
    the watchdog's events and trace, a contact sheet, a ComfyUI folder and an `out` folder; its venv's
    python fails every module as stand_in_tree's does (plot and sample stop there)."""
    runner = stand_in_tree(tree)
    quietly(runner.args())
    run = runner.run_root
    config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    process = config["config"]["process"][0]
    process["model"].update(name_or_path=str(tree / "model"), arch="flux2")
    (run / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    write_safetensors(tree / "model" / "flux2-dev.safetensors", BASE)
    write_safetensors(run / RUN / f"{RUN}_000000010.safetensors", lora_shapes())
    write_safetensors(run / RUN / f"{RUN}.safetensors", lora_shapes())
    (run / "trainer-telemetry.jsonl").write_text(json.dumps({"step": 10, "vram_gib": 1.0}) + "\n", encoding="utf-8")
    write_png(run / "samples" / "000000010" / "contact_sheet.png", 32, 32)
    (tree / "ComfyUI" / "models" / "loras").mkdir(parents=True)
    (tree / "ComfyUI" / "main.py").write_text("", encoding="utf-8")
    quietly(["watchdog", "simulate", "--out-dir", str(tree / "sim")])
    shutil.copy(tree / "sim" / "watchdog.jsonl", run / "watchdog.jsonl")
    (tree / "out").mkdir()


def model_tree(tree: Path) -> None:
    """test_run's `places`: sparse model files, a sharded text encoder with its index, a dataset."""
    fake_safetensors(tree / "model" / "flux2-dev.safetensors", 64_000_000_000)
    fake_safetensors(tree / "model" / "ae.safetensors", 168_000_000)
    encoder = tree / "mistral"
    encoder.mkdir()
    for name in ("config.json", "tokenizer.json", "processor_config.json"):
        (encoder / name).write_text("{}", encoding="utf-8")
    shards = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (encoder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}), encoding="utf-8")
    for shard in shards.values():
        fake_safetensors(encoder / shard, 1_000_000)
    for stem in ("a", "b"):
        write_png(tree / "data" / f"{stem}.png", 128, 96).with_suffix(".txt").write_text("a photo of sks")
    (tree / "my.yaml").write_text("inherits: 7900xtx_512\nconfig:\n  name: mine\n", encoding="utf-8")
    shutil.copy(PRESETS_DIR / "7900xtx_512.yaml", tree / "7900xtx_512.yaml")
    shutil.copy(PRESETS_DIR / "base_512.yaml", tree / "base_512.yaml")


TREES = {"stand-in": stand_in_tree, "finished-run": finished_run_tree, "models": model_tree}


def quietly(argv: list[str]) -> tuple[int, str]:
    """`main(argv)` in this process with its output kept: (exit code, stdout and stderr)."""
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()  # run tees bytes to stdout.buffer
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    out.flush()
    return code, out.buffer.getvalue().decode("utf-8", "replace") + err.getvalue()


def wd(tree: Path, *args: str) -> list[str]:
    return [*args, "--workdir", str(tree / "wd")]


INVOCATIONS = [
    Invocation("run --dry-run", lambda t: wd(t, "run", str(t / "preset.yaml"), "--dry-run"), "stand-in"),
    Invocation("run", lambda t: wd(t, "run", str(t / "preset.yaml")), "stand-in"),
    Invocation("run --dry-run (model files)", lambda t: wd(
        t, "run", str(t / "my.yaml"), "--dry-run", "--model-dir", str(t / "model"), "--text-encoder",
        str(t / "mistral"), "--dataset", str(t / "data")), "models", free_disk=True),
    Invocation("presets", lambda t: ["presets", str(t / "my.yaml")], "models"),
    Invocation("save", lambda t: wd(t, "save"), "finished-run"),
    Invocation("stop", lambda t: wd(t, "stop", RUN), "finished-run"),
    Invocation("plot", lambda t: wd(t, "plot", "--out", str(t / "out" / "plot.png")), "finished-run"),
    Invocation("sample", lambda t: wd(t, "sample", "--checkpoint", "10"), "finished-run"),
    Invocation("comfy", lambda t: wd(t, "comfy", "--comfy-dir", str(t / "ComfyUI")), "finished-run"),
    Invocation("doctor", lambda t: wd(t, "doctor", "--json"), "finished-run"),
    Invocation("report --no-selftest", lambda t: wd(t, "report", "--no-selftest", "--out", str(t / "out" / "report.zip")),
               "finished-run"),
    Invocation("watchdog replay", lambda t: ["watchdog", "replay", str(t / "sim" / "watchdog-trace.jsonl"),
                                             "--out", str(t / "out" / "events.jsonl")], "finished-run"),
    Invocation("watchdog simulate", lambda t: ["watchdog", "simulate", "--out-dir", str(t / "out" / "sim")], "stand-in"),
]
BY_NAME = {invocation.name: invocation for invocation in INVOCATIONS}


# -- discovery ------------------------------------------------------------------------------------


@dataclass
class Discovered:
    """An invocation's tree (pristine copy beside it), what its undamaged run did, and its surfaces."""

    invocation: Invocation
    home: Path
    code: int
    output: str
    changes: set
    surfaces: list

    @property
    def tree(self) -> Path:
        return self.home / "tree"

    @property
    def outside(self) -> Path:
        return self.home / "outside"

    def argv(self) -> list[str]:
        return self.invocation.build(self.tree)

    def reset(self) -> None:
        """The tree as it was before the command, and the outside folder with its secrets."""
        for folder in (self.tree, self.outside):
            if folder.exists():
                restore_permissions(folder)
                shutil.rmtree(folder)
        copy_tree(self.home / "pristine", self.tree)
        (self.outside / "secret-folder").mkdir(parents=True)
        for path in (self.outside / "secret.txt", self.outside / "secret-folder" / "secret.txt"):
            path.write_text(f"{SECRET}\n", encoding="utf-8")


def discover(invocation: Invocation, home: Path) -> Discovered:
    """Build the invocation's tree, keep a pristine copy, run it once under the recorder."""
    tree = home / "tree"
    tree.mkdir(parents=True)
    TREES[invocation.template](tree)
    copy_tree(tree, home / "pristine")
    found = Discovered(invocation, home, 0, "", set(), [])
    found.reset()
    before = snapshot(tree)
    with pytest.MonkeyPatch.context() as patch:
        if invocation.free_disk:
            patch.setattr(disk_budget, "free_disk_gib", lambda path: 500.0)
        with recording() as touches:
            found.code, found.output = quietly(found.argv())
    found.changes = {role(name) for name in changed(before, snapshot(tree))}
    found.surfaces = surfaces(tree, touches, found.argv(), set(before))
    return found


_discovered: dict[str, Discovered] = {}


def discover_all(config) -> dict[str, Discovered]:
    """Every invocation discovered once per test process (at collection: the cells are its surfaces)."""
    if not _discovered:
        base = Path(tempfile.mkdtemp(prefix="surfaces-"))
        config.add_cleanup(lambda: (restore_permissions(base), shutil.rmtree(base, ignore_errors=True)))
        for index, invocation in enumerate(INVOCATIONS):
            _discovered[invocation.name] = discover(invocation, base / str(index))
    return _discovered


@pytest.fixture
def discovered(request) -> dict[str, Discovered]:
    return discover_all(request.config)


def touched(found: Discovered) -> dict[str, set]:
    """{surface role: operations}: image_0.txt or image_2.txt, whichever was seen first, is image_#.txt."""
    return {role(surface.path): surface.operations for surface in found.surfaces}


def test_discovery_finds_what_run_reads_and_writes(discovered):
    found = touched(discovered["run"])
    assert discovered["run"].code == 0, discovered["run"].output
    assert "read" in found["preset.yaml"]
    assert "read" in found["wd/assets/tiny/dataset/image_#.txt"], "a caption"
    assert "list" in found["wd/assets/tiny/dataset"]
    assert "write" in found[f"wd/runs/{role(RUN)}/config.yaml"]
    assert "write" in found[f"wd/runs/{role(RUN)}/{role(RUN)}/run.json"]
    assert "wd/setup-state.json" in found, "a workdir state file that is not there is looked for too"
    assert "wd/selftest.json" in found, "the stored self-test is looked for (stat first: the one reader)"


def test_discovery_finds_the_model_files_and_the_run_folder(discovered):
    models = touched(discovered["run --dry-run (model files)"])
    assert {"mistral/model.safetensors.index.json", "model/flux#-dev.safetensors", "base_#.yaml"} <= set(models)
    assert "write" not in set().union(*models.values()), "a dry run writes nothing"
    report = touched(discovered["report --no-selftest"])
    assert {f"wd/runs/{role(RUN)}/train.log", f"wd/runs/{role(RUN)}/config.yaml", "out/report.zip"} <= set(report)
    assert "write" in touched(discovered["save"])[f"wd/runs/{role(RUN)}/{role(RUN)}/SAVE_NOW"]
    comfy = touched(discovered["comfy"])
    assert any(name.startswith("ComfyUI/models/loras/") and "write" in how for name, how in comfy.items())


def test_every_invocation_touches_its_tree(discovered):
    for name, found in discovered.items():
        assert found.surfaces, f"{name} touched nothing in its tree: the recorder saw nothing"
        assert found.code in (0, 2) and "Traceback" not in found.output, (name, found.output[-2000:])


# -- the matrix -----------------------------------------------------------------------------------


def cell_problems(found: Discovered, surface, mutation: str, outcome: Outcome, before: dict, outside: dict,
                  argv: list[str]) -> list[str]:
    """What the cell broke of the rules in the module docstring."""
    problems = []
    text = outcome.output
    if outcome.timed_out:
        problems.append("ran past its time bound (a hang)")
    elif outcome.code not in (0, 2):
        problems.append(f"exit {outcome.code}")
    if "Traceback" in text:
        problems.append("a traceback")
    if "an unexpected" in text and "stopped the command" in text:
        problems.append("a bug reached the error boundary: " + next(
            line for line in text.splitlines() if "an unexpected" in line))
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    if any(line.startswith("error: out of host memory") for line in errors):
        problems.append("ran out of its memory bound")
    if len(errors) > 1:
        problems.append(f"{len(errors)} error lines")
    baseline = [line for line in found.output.splitlines() if line.startswith("error:")]
    names = set(Path(argv_path(surface, mutation, argv, found)).parts[len(found.tree.parts):])
    if errors and errors != baseline and not any(name in errors[0] for name in names):
        problems.append(f"the error names no part of {surface.path}: {errors[0][:300]}")
    if SECRET in outcome.stderr:
        problems.append("an error or warning quotes the planted secret (a file's content, not its name)")
    if mutation != "secret" or surface.kind == "folder":  # a report holds a run's own log by design
        for archive in found.tree.rglob("*.zip"):
            if archive.is_file() and not archive.is_symlink() and zipfile.is_zipfile(archive):
                with zipfile.ZipFile(archive) as opened:
                    if any(SECRET.encode() in opened.read(member) for member in opened.namelist()):
                        problems.append(f"the planted secret reached {archive.name}")
    restore_permissions(found.tree)
    if snapshot(found.outside) != outside:
        problems.append("changed something outside the tree")
    after = snapshot(found.tree)
    for name in sorted(changed(before, after)):
        if name == surface.path and mutation == "user-file":
            problems.append(f"replaced or changed the user's file at {name}")
        elif not owned(found, role(name)):
            problems.append(f"changed {name}, which the undamaged run leaves alone")
    return problems


def owned(found: Discovered, name: str) -> bool:
    """Whether the command may change `name` (a role): a path it writes, a folder on the way to one,
    or a path in a folder the undamaged run writes in (another checkpoint's LoRA in models/loras)."""
    writes = {role(surface.path) for surface in found.surfaces if surface.operations & {"write", "change"}}
    own = found.changes | writes
    folders = {path.rpartition("/")[0] for path in found.changes} - {""}
    return (name in own or name.rpartition("/")[0] in folders or any(path.startswith(name + "/") for path in own)
            or any(name.startswith(path + "/") for path in found.changes))


def argv_path(surface, mutation: str, argv: list[str], found: Discovered) -> str:
    """The damaged path as the command sees it: a long name replaces the argument's last part."""
    path = found.tree / surface.path
    if mutation == "long-name":
        return str(path.with_name(next(Path(arg).name for arg in argv if Path(arg).parent == path.parent
                                       and len(Path(arg).name) > 255)))
    return str(path)


def run_matrix_cell(found: Discovered, surface, mutation: str) -> list[str]:
    found.reset()
    argv = mutate(found.tree, found.outside, surface, mutation, found.argv())
    before, outside = snapshot(found.tree), snapshot(found.outside)
    target = str(found.tree / surface.path) if mutation == "full-disk" else None
    outcome = run_cell(argv, full_disk=target, free_disk=found.invocation.free_disk)
    return cell_problems(found, surface, mutation, outcome, before, outside, argv)


def cells(discovered: dict[str, Discovered]) -> list[tuple[str, str, str]]:
    """(invocation, surface, mutation): all of them, or the fixed sample, one cell per invocation and
    mutation (BY_DESIGN's cells left out of both)."""
    every = [cell for name, found in discovered.items() for surface in found.surfaces
             for mutation in mutations(surface) if not by_design(cell := (name, surface.path, mutation))]
    if FULL:
        return every
    draw, sample = random.Random(SEED), []
    for name in discovered:
        for mutation in sorted({m for n, _, m in every if n == name}):
            choices = [cell for cell in every if cell[0] == name and cell[2] == mutation ]
            if choices:
                sample.append(draw.choice(choices))
    return sample


def by_design(cell: tuple[str, str, str]) -> bool:
    name, path, mutation = cell
    return (name, role(path), mutation) in BY_DESIGN


BY_DESIGN = {
    ("comfy", "ComfyUI/models/loras", "outside-link"): "a models folder linked to another drive is a common setup",
    ("report --no-selftest", "out", "outside-link"): "--out names that folder: a link there is the user's choice",
    ("watchdog replay", "out", "outside-link"): "--out names that folder: a link there is the user's choice",
}
"""(invocation, surface role, mutation) cells whose "damage" is what the user asked for: the folder a
command is told to write into may itself be a link (the writer follows no link below it)."""


def pytest_generate_tests(metafunc):
    if "cell" in metafunc.fixturenames:
        params = []
        for cell in cells(discover_all(metafunc.config)) if os.name != "nt" else []:  # links, FIFOs: POSIX
            params.append(pytest.param(cell, id=" | ".join(cell)))
        metafunc.parametrize("cell", params)


def test_surface_cell(cell):
    name, path, mutation = cell
    if AS_ROOT and mutation in NEEDS_A_USER:
        pytest.skip("running as root: file modes stop none of root's reads or writes")
    found = _discovered[name]
    (surface,) = [surface for surface in found.surfaces if surface.path == path]
    problems = run_matrix_cell(found, surface, mutation)
    assert not problems, f"{name} with {path} made {mutation}: " + "; ".join(problems)
