"""What the surface matrix (tests/test_surfaces.py) found on the read side, one named test each:
state files, safetensors headers and indexes, traces and telemetry rows that a FIFO, /dev/zero, a
file of NULs or a JSON nested thousands of levels deep turned into a hang, a flood of memory or a
bug's traceback; and whole files quoted in an error line."""

import json
import os
import signal

import pytest
from test_comfy import BASE, write_safetensors

from flux2_contract.families import KLEIN_4B
from launcher.cli import main
from launcher.comfy import folder
from launcher.envs import rocm_windows_toolchain
from launcher.envs.workdir import read_state
from launcher.errors import LauncherError
from launcher.in_trainer import plot, tiny_assets
from launcher.runs import images, load_report, run_lock, validate
from launcher.runs.schema import check_preset
from launcher.user_files import UserFileError, last_rows, load_json
from launcher.watchdog.replay import read_jsonl

try:
    import resource
except ImportError:  # Windows, where this module skips as a whole: its import must not fail collection
    resource = None

pytestmark = pytest.mark.skipif(os.name == "nt", reason="FIFOs, /dev/zero and alarms as POSIX has them")
NESTED = "[" * 100_000 + "]" * 100_000


@pytest.fixture(autouse=True)
def bounded():
    """A read that waits on a FIFO fails the test instead of hanging it."""
    def expired(signum, frame):
        raise TimeoutError("a read blocked")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("plant", ["fifo", "dev-zero", "nested", "a list"])
def test_workdir_state_files_that_are_not_json_objects_read_as_none(tmp_path, plant):
    path = tmp_path / "setup-state.json"
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text(NESTED if plant == "nested" else "[1, 2]", encoding="utf-8")
    (tmp_path / rocm_windows_toolchain.ENV_FILE).symlink_to(path)
    assert read_state(path) == {}
    assert rocm_windows_toolchain.stored_env(tmp_path) == {}


def test_a_fifo_named_like_a_checkpoint_is_refused_not_waited_on(fifo):
    with pytest.raises(UserFileError, match="FIFO"):
        validate.safetensors_header(fifo)
    with pytest.raises(UserFileError, match="FIFO"):
        folder._sha256(fifo)


def test_a_header_nested_thousands_deep_is_a_damaged_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(NESTED).to_bytes(8, "little") + NESTED.encode())
    with pytest.raises(LauncherError, match="model.safetensors"):
        validate.safetensors_header(path)


@pytest.mark.parametrize("index, words", [
    (NESTED, "nests too deeply"),
    ('{"weight_map": ["a.safetensors"]}', "needs a weight_map"),
    ('["weight_map"]', "needs a weight_map"),
    ('{"weight_map": {"a": 5}}', "maps a tensor to a int"),
    ('{"weight_map": {"a": "../../../etc/x.safetensors"}}', "'../../../etc/x.safetensors', not a .safetensors file beside"),
    ('{"weight_map": {"a": "/etc/passwd"}}', "not a .safetensors file beside the index"),
    ('{"weight_map": {"a": ".."}}', "not a .safetensors file beside the index"),
], ids=["nested", "a list of shards", "not an object", "a number", "up and out", "absolute", "dot-dot"])
def test_a_safetensors_index_names_only_shards_beside_it(tmp_path, index, words):
    (tmp_path / "model.safetensors.index.json").write_text(index, encoding="utf-8")
    with pytest.raises(LauncherError, match="model.safetensors.index.json") as error:
        validate.check_weight_shards(tmp_path)
    assert words in str(error.value)


def test_the_shards_of_a_good_index_are_checked(tmp_path):
    write_safetensors(tmp_path / "model-1.safetensors", BASE)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    assert validate.index_shards(tmp_path / "model.safetensors.index.json") == ["model-1.safetensors"]
    validate.check_weight_shards(tmp_path)


def test_a_model_config_that_is_no_object_is_named(tmp_path):
    config = tmp_path / "config.json"
    for text in (NESTED, "[]"):
        config.write_text(text, encoding="utf-8")
        with pytest.raises(LauncherError, match="config.json"):
            validate.check_model_type(config, KLEIN_4B)


def test_a_preset_file_of_one_line_is_named_by_its_kind_never_quoted():
    (problem,) = check_preset("sk-live-0123456789")
    assert "a line of text, not a mapping" in problem and "sk-live" not in problem


def test_a_planted_lock_note_names_no_holder(tmp_path):
    os.mkfifo(tmp_path / run_lock.INFO_FILE)
    assert run_lock.holder(tmp_path) == "another process (it has not written who it is yet)"


def test_telemetry_rows_skip_what_is_not_an_object(tmp_path, fifo):
    path = tmp_path / "trainer-telemetry.jsonl"
    path.write_text("\n".join([NESTED, "[1]", '{"event": "first_step", "since_start_s": 3}', '{"cut'])
                    + "\n", encoding="utf-8")
    assert load_report.read_rows(path) == [{"event": "first_step", "since_start_s": 3}]
    assert load_report.summarize(load_report.read_rows(path))["to_first_step_s"] == 3
    assert load_report.read_rows(fifo) == []
    assert last_rows(path) == [{"event": "first_step", "since_start_s": 3}]
    assert plot._row(NESTED, events=False) == (None, "not JSON")


@pytest.mark.parametrize("plant, words", [
    ("nuls", "line 1 is over 1,048,576 bytes"),
    ("fifo", "FIFO"),
    ("nested", "line 2 is not a JSON object"),
    ("list", "line 2 is not a JSON object"),
])
def test_a_trace_that_is_not_json_rows_is_one_error_line(tmp_path, capsys, plant, words):
    trace = tmp_path / "watchdog-trace.jsonl"
    if plant == "nuls":
        with trace.open("wb") as handle:
            handle.truncate(2**30)
    elif plant == "fifo":
        os.mkfifo(trace)
    else:
        trace.write_text('{"kind": "gpu"}\n' + (NESTED if plant == "nested" else "[1, 2]") + "\n", encoding="utf-8")
    with pytest.raises(UserFileError, match=words):
        read_jsonl(trace)
    assert main(["watchdog", "replay", str(trace), "--out", str(tmp_path / "events.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and str(trace) in err and "Traceback" not in err


def test_a_large_file_that_is_no_image_is_refused_unread(tmp_path):
    path = tmp_path / "image.png"
    with path.open("wb") as handle:
        handle.truncate(2**30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(images.BadImage, match="not a PNG, JPEG or WebP"):
        images.image_size(path)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 256 * 1024, "the file was read whole"


def test_load_json_names_the_file_whatever_it_holds(tmp_path, fifo):
    path = tmp_path / "x.json"
    for text, words in ((NESTED, "nests too deeply"), ("{", "is not valid JSON"), ("\xe9", None)):
        path.write_bytes(text.encode("latin-1"))
        with pytest.raises(UserFileError, match=words or "UTF-8"):
            load_json(path, "metadata")
    with pytest.raises(UserFileError, match="FIFO"):
        load_json(fifo, "metadata")


def test_a_planted_giant_telemetry_file_is_read_from_its_end_only(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    with path.open("wb") as handle:
        handle.truncate(2**30)
        handle.seek(2**30)
        handle.write(b'\n{"step": 7, "loss": 0.5}\n')
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert plot.read_rows(path) == ([{"step": 7, "loss": 0.5}], [])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024, "the file was read whole"


@pytest.mark.parametrize("plant", ["giant", "nested"])
def test_a_tiny_assets_manifest_that_is_no_manifest_means_none_built(tmp_path, plant):
    manifest = tmp_path / tiny_assets.MANIFEST_NAME
    if plant == "giant":
        with manifest.open("wb") as handle:
            handle.truncate(2**30)
    else:
        manifest.write_text(NESTED, encoding="utf-8")
    assert tiny_assets.read_manifest(tmp_path, tiny_assets.DEFAULT_SEED) is None
