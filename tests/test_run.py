"""`run` before training starts: validation errors, --dry-run of every preset, flags, Windows paths."""

import json
import os
import re
import struct
from pathlib import Path, PureWindowsPath

import pytest
import yaml
from conftest import REPO_ROOT, write_png

from flux2_contract import qcache_index, safetensors_header
from launcher.cli import main
from launcher.envs.workdir import Workdir, venv_python
from launcher.runs import disk_budget
from launcher.runs.folders import RunFolder
from launcher.runs.presets import PRESETS_DIR, load_preset, read_preset, render

ALL_PRESETS = sorted(p.name for p in PRESETS_DIR.glob("*.yaml"))
# FLUX.2 klein needs the target upstream-main; its dry runs are in tests/test_klein.py and test_klein_run.py
REAL_PRESETS = [name for name in ALL_PRESETS if not name.startswith(("tiny", "klein"))]


def fake_safetensors(path: Path, nbytes: int, truncate_by: int = 0) -> None:
    """A header describing one tensor of `nbytes`, as a sparse file (no disk used)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + nbytes - truncate_by)


@pytest.fixture
def places(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 500.0)  # not this machine's disk
    model = tmp_path / "model"
    fake_safetensors(model / "flux2-dev.safetensors", 64_000_000_000)
    fake_safetensors(model / "ae.safetensors", 168_000_000)
    encoder = tmp_path / "mistral"
    encoder.mkdir()
    for name in ("config.json", "tokenizer.json", "processor_config.json"):
        (encoder / name).write_text("{}")
    shards = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (encoder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    for shard in shards.values():
        fake_safetensors(encoder / shard, 1_000_000)
    data = tmp_path / "data"
    data.mkdir()
    for stem in ("a", "b"):
        write_png(data / f"{stem}.png", 128, 96)
        (data / f"{stem}.txt").write_text("a photo of sks")
    return {"model": model, "encoder": encoder, "data": data, "workdir": tmp_path / "wd"}


def dry_run(places, preset="7900xtx_512.yaml", *extra, workdir=None):
    return main([
        "run", str(PRESETS_DIR / preset), "--dry-run", "--workdir", str(workdir or places["workdir"]),
        "--model-dir", str(places["model"]), "--text-encoder", str(places["encoder"]),
        "--dataset", str(places["data"]), *extra,
    ])


def rendered_config(out: str) -> dict:
    """The config a dry run prints, before its NAME=value environment lines."""
    return yaml.safe_load(re.split(r"\n(?=[A-Z][A-Z0-9_]*=)", out, maxsplit=1)[0])


@pytest.fixture(scope="module")
def fork_workdir(tmp_path_factory, fork_reachable):
    """A patched checkout without a venv: enough for the config-key checks."""
    root = tmp_path_factory.mktemp("fork-wd")
    assert main(["setup", "--workdir", str(root), "--no-install"]) == 0
    return root


@pytest.mark.trainer
@pytest.mark.parametrize("preset", REAL_PRESETS)
def test_dry_run_of_every_shipped_preset(places, fork_workdir, capsys, preset):
    assert dry_run(places, preset, workdir=fork_workdir) == 0
    out = capsys.readouterr().out
    config = rendered_config(out)
    process = config["config"]["process"][0]
    assert process["model"]["model_kwargs"]["quantized_cache_dir"] == str(fork_workdir / "cache" / "quantized")
    assert process["model"]["model_kwargs"]["text_embedding_cache_dir"] == str(fork_workdir / "cache" / "text")
    assert "AITK_" not in out.replace("$AITK_", ""), "the trainer is handed no AITK_ variable"
    assert process["model"]["name_or_path"] == str(places["model"])
    assert process["model"]["model_kwargs"]["text_encoder_path"] == str(places["encoder"])
    assert process["datasets"][0]["folder_path"] == str(places["data"])
    assert process["training_folder"].startswith(str(fork_workdir))
    assert process["model"]["layer_offloading"] is False  # wall 5: block swap deadlocks the HIP driver
    assert process["train"]["disable_sampling"] is True  # wall 6: sampling deadlocks, 4-bit previews are black
    assert "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True" in out  # wall 7
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    assert not (fork_workdir / "runs").exists(), "a dry run writes nothing"


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_every_shipped_preset_renders_with_walls_5_and_6_kept_off(preset):
    """The tiny preset too: its rendered config is what the tests train with."""
    places = {"model_dir": Path("m"), "dataset": Path("d"), "text_encoder": Path("t")}
    manifest = {"name_or_path": "m", "model_kwargs": {}, "dataset": "d", "resolution": 64}
    loaded = load_preset(preset.removesuffix(".yaml"))
    config = render(loaded, Path("runs") / "x", **({"tiny_manifest": manifest} if loaded.tiny else {"places": places}))
    for process in config["config"]["process"]:
        assert process["model"]["layer_offloading"] is False, preset
        assert process["train"]["disable_sampling"] is True, preset


def test_allocator_default_switches_wall_7_off(places, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 500.0)
    preset = read_preset("7900xtx_512").data
    preset["launcher"]["allocator"] = "default"
    path = tmp_path / "default_allocator.yaml"
    path.write_text(yaml.safe_dump(preset))
    assert main(["run", str(path), "--dry-run", "--workdir", str(places["workdir"]), "--model-dir", str(places["model"]),
                 "--text-encoder", str(places["encoder"]), "--dataset", str(places["data"])]) == 0
    out = capsys.readouterr().out
    assert "PYTORCH_HIP_ALLOC_CONF" not in out and "PYTORCH_CUDA_ALLOC_CONF" not in out


def test_448_bs2_scales_lr_by_sqrt_two():
    base = load_preset("7900xtx_512").config["config"]["process"][0]["train"]
    bs2 = load_preset("7900xtx_448_bs2").config["config"]["process"][0]["train"]
    assert bs2["batch_size"] == 2
    assert bs2["lr"] == pytest.approx(base["lr"] * 2**0.5, rel=1e-5)


@pytest.mark.trainer
def test_unknown_key_names_the_closest_known_key(places, fork_workdir, tmp_path, capsys):
    preset = read_preset("7900xtx_512").data
    preset["config"]["process"][0]["train"]["gradient_checkpoint"] = True
    preset["config"]["process"][0]["model"]["qtyp"] = "uint4"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(preset))
    assert main(["run", str(path), "--dry-run", "--workdir", str(fork_workdir), "--model-dir", str(places["model"]),
                 "--text-encoder", str(places["encoder"]), "--dataset", str(places["data"])]) == 2
    err = capsys.readouterr().err
    assert ("config.process[0].train.gradient_checkpoint: unknown key (the trainer would silently "
            "ignore it); did you mean `gradient_checkpointing`?") in err
    assert "config.process[0].model.qtyp: unknown key" in err and "did you mean `qtype`?" in err
    assert "2 problems; nothing was started" in err


def test_unknown_launcher_key(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"launcher": {"alocator": "default"}, "config": {"name": "x", "process": []}}))
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "launcher.alocator: unknown key (not a setting); did you mean `allocator`?" in err
    assert "config.process = []: too few items" in err and "job is missing" in err


def broken(places, what):
    if what == "no model dir":
        places["model"] = places["model"] / "missing"
    elif what == "no transformer":
        (places["model"] / "flux2-dev.safetensors").unlink()
    elif what == "truncated transformer":
        fake_safetensors(places["model"] / "flux2-dev.safetensors", 64_000_000_000, truncate_by=4096)
    elif what == "small transformer":
        fake_safetensors(places["model"] / "flux2-dev.safetensors", 2_000_000_000)
    elif what == "garbage vae":
        (places["model"] / "ae.safetensors").write_bytes(b"\xff" * 64)
    elif what == "encoder without processor":
        (places["encoder"] / "processor_config.json").unlink()
    elif what == "encoder not cached":
        places["encoder"] = Path("someone/not-downloaded")
    elif what == "encoder shard missing":
        (places["encoder"] / "model-00002-of-00002.safetensors").unlink()
    elif what == "encoder shard truncated":
        fake_safetensors(places["encoder"] / "model-00001-of-00002.safetensors", 1_000_000, truncate_by=10)
    elif what == "uncaptioned image":
        (places["data"] / "b.txt").unlink()
    elif what == "empty dataset":
        for path in places["data"].iterdir():
            path.unlink()


@pytest.mark.parametrize("what, message", [
    ("no model dir", "does not exist; pass --model-dir"),
    ("no transformer", "flux2-dev.safetensors is missing"),
    ("truncated transformer", "truncated or still downloading"),
    ("small transformer", "about 64 GB"),
    ("garbage vae", "ae.safetensors: header length"),
    ("encoder without processor", "lacks processor_config.json"),
    ("encoder not cached", "neither a local folder nor in the Hugging Face cache"),
    ("encoder shard missing", "lacks 1 of the 2 weight shards its index names (model-00002-of-00002"),
    ("encoder shard truncated", "model-00001-of-00002.safetensors: malformed safetensors header: tensor 'w': data_offsets"),
    ("uncaptioned image", "1 of 2 images"),
    ("empty dataset", "holds no images"),
])
def test_each_bad_input_is_refused_with_how_to_fix(places, capsys, monkeypatch, what, message):
    monkeypatch.setenv("HF_HUB_CACHE", str(places["workdir"] / "hf"))
    broken(places, what)
    assert dry_run(places) == 2
    assert message in capsys.readouterr().err


def test_an_encoder_folder_gone_is_accepted_when_the_text_cache_remembers_it(places, capsys, monkeypatch):
    monkeypatch.delenv("AITK_TEXT_CACHE_DIR", raising=False)
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 1000.0)  # disk is not what this checks
    record = places["workdir"] / "cache" / "text" / "encoder-0123456789abcdef.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"path": str(places["encoder"].resolve()), "identity": "x", "hidden_size": 5120}))
    for path in places["encoder"].iterdir():
        path.unlink()
    places["encoder"].rmdir()
    assert dry_run(places) == 0
    assert "the text phase will use the embeddings cached from it" in capsys.readouterr().out
    record.unlink()
    assert dry_run(places) == 2
    assert "neither a local folder nor in the Hugging Face cache" in capsys.readouterr().err


def test_missing_locations_name_the_flag_and_variable(capsys, monkeypatch):
    monkeypatch.delenv("FLUX2_MODEL_DIR", raising=False)
    assert main(["run", "7900xtx_512", "--dry-run"]) == 2
    assert "--model-dir (or $FLUX2_MODEL_DIR)" in capsys.readouterr().err


def test_locations_from_environment_variables(places, capsys, monkeypatch):
    monkeypatch.setenv("FLUX2_MODEL_DIR", str(places["model"]))
    monkeypatch.setenv("FLUX2_DATASET", str(places["data"]))
    monkeypatch.setenv("FLUX2_TEXT_ENCODER", str(places["encoder"]))
    assert main(["run", "7900xtx_512", "--dry-run", "--workdir", str(places["workdir"])]) == 0
    assert f"folder_path: {places['data']}" in capsys.readouterr().out


def test_resolution_must_be_a_multiple_of_16(places, tmp_path, capsys):
    preset = read_preset("7900xtx_512").data
    preset["config"]["process"][0]["datasets"][0]["resolution"] = [500]
    path = tmp_path / "res.yaml"
    path.write_text(yaml.safe_dump(preset))
    assert main(["run", str(path), "--dry-run", "--workdir", str(places["workdir"]), "--model-dir", str(places["model"]),
                 "--text-encoder", str(places["encoder"]), "--dataset", str(places["data"])]) == 2
    err = capsys.readouterr().err
    assert "config.process[0].datasets[0].resolution[0] = 500: not a multiple of 16 (use 496 or 512)" in err


def test_too_little_disk(places, capsys, monkeypatch):
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 3.5)
    assert dry_run(places) == 2
    err = capsys.readouterr().err
    assert "only 3.5 GiB free" in err and "quantized transformer cache" in err



def write_quantized_cache(cache_dir: Path, checkpoint: Path, qtype: str, truncate_by: int = 0) -> Path:
    """A cache file named and keyed by the trainer's own cache code (source checkpoint
    fingerprint, cache qtype): safetensors whose metadata holds the key."""
    index = qcache_index
    key = {"qtype": qtype, "source": safetensors_header.source_fingerprint(checkpoint)}
    header = json.dumps({
        "__metadata__": {"format": index.FORMAT_NAME, index.META_KEY: json.dumps({"key": key})},
        "w": {"dtype": "U8", "shape": [4096], "data_offsets": [0, 4096]},
    }).encode()
    path = cache_dir / index.cache_file_name(checkpoint, qtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4096 - truncate_by))
    return path


def test_a_valid_quantized_cache_is_not_counted_again(places, capsys, monkeypatch):
    """20 GiB free: too little for a first launch (a ~17 GiB cache to write plus checkpoints),
    enough for a relaunch whose cache exists; a stale or truncated cache still counts."""
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 20.0)
    monkeypatch.delenv("AITK_QUANT_CACHE_DIR", raising=False)
    cache_dir = Workdir(places["workdir"].resolve()).quantized_cache
    checkpoint = places["model"].resolve() / "flux2-dev.safetensors"
    assert dry_run(places) == 2
    assert "quantized transformer cache" in capsys.readouterr().err

    # qtype auto with a memory plan and no self-test: int4_fused (its plain-PyTorch path), which can stream
    write_quantized_cache(cache_dir, checkpoint, "int4_fused", truncate_by=1)
    assert dry_run(places) == 2, "a truncated cache is not valid"
    capsys.readouterr()
    write_quantized_cache(cache_dir, checkpoint, "uint4")
    assert dry_run(places) == 2, "a cache of another qtype is not the one this run loads"
    capsys.readouterr()

    write_quantized_cache(cache_dir, checkpoint, "int4_fused")
    assert dry_run(places) == 0
    assert "disk: quantized transformer cache: valid cache flux2-dev-int4_fused" in capsys.readouterr().out

    os.utime(checkpoint, ns=(0, 0))  # the checkpoint changed since: the cache is stale
    assert dry_run(places) == 2


def test_int4_w4a8_counts_the_int4_fused_cache_it_loads(places, tmp_path, capsys, monkeypatch):
    """int4_w4a8 is int4_fused's model with other matmuls: the trainer loads int4_fused's cache
    file for it, so a relaunch with that file needs no second 17 GiB."""
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 20.0)
    monkeypatch.delenv("AITK_QUANT_CACHE_DIR", raising=False)
    preset = read_preset("7900xtx_512").data
    preset["config"]["process"][0]["model"]["qtype"] = "int4_w4a8"
    path = tmp_path / "w4a8.yaml"
    path.write_text(yaml.safe_dump(preset))
    checkpoint = places["model"].resolve() / "flux2-dev.safetensors"
    write_quantized_cache(Workdir(places["workdir"].resolve()).quantized_cache, checkpoint, "int4_fused")
    assert dry_run(places, path) == 0, capsys.readouterr().err
    assert "disk: quantized transformer cache: valid cache flux2-dev-int4_fused" in capsys.readouterr().out


def test_cached_latents_are_not_counted_again(places, monkeypatch):
    config = render(load_preset("7900xtx_512"), places["workdir"] / "runs" / "x",
                    places={"model_dir": places["model"], "dataset": places["data"], "text_encoder": places["encoder"]})
    config["config"]["process"][0]["datasets"][0]["resolution"] = [1024] * 64  # make latents count
    run_root = places["workdir"] / "runs" / "x"
    cache_dir = places["workdir"] / "cache"

    def latent_gib():
        needs = disk_budget.run_needs(config, run_root, cache_dir)
        return next(n.gib for n in needs if n.what == "latent cache")

    before = latent_gib()
    (places["data"] / "_latent_cache").mkdir()
    (places["data"] / "_latent_cache" / "a_Xy3.safetensors").write_bytes(b"")
    assert latent_gib() == pytest.approx(before / 2)


def test_windows_paths_render_and_venv_layout():
    preset = load_preset("7900xtx_512")
    places = {"model_dir": PureWindowsPath(r"C:\Users\me\models\FLUX.2-dev"),
              "dataset": PureWindowsPath(r"D:\data\sks person"),
              "text_encoder": PureWindowsPath(r"C:\Users\me\models\Mistral-Small-3.1")}
    config = render(preset, Path("runs") / "x", places=places)
    back = yaml.safe_load(yaml.safe_dump(config))["config"]["process"][0]
    assert back["model"]["name_or_path"] == r"C:\Users\me\models\FLUX.2-dev"
    assert back["datasets"][0]["folder_path"] == r"D:\data\sks person"
    assert back["model"]["model_kwargs"]["text_encoder_path"] == r"C:\Users\me\models\Mistral-Small-3.1"
    assert venv_python(Path("C:/aitk/venv"), windows=True).parts[-2:] == ("Scripts", "python.exe")
    assert venv_python(Path("/aitk/venv"), windows=False).parts[-2:] == ("bin", "python")


def test_save_and_stop_write_flag_files_in_the_latest_run(tmp_path, capsys):
    runs = tmp_path / "wd" / "runs"
    for name in ("older", "newer"):
        (runs / name).mkdir(parents=True)
        (runs / name / "config.yaml").write_text(yaml.safe_dump({"config": {"name": f"job_{name}"}}))
    assert main(["save", "--workdir", str(tmp_path / "wd")]) == 0
    assert (runs / "newer" / "job_newer" / "SAVE_NOW").is_file()
    assert main(["stop", "older", "--workdir", str(tmp_path / "wd")]) == 0
    assert (runs / "older" / "job_older" / "STOP_NOW").is_file()
    assert main(["stop", "nope", "--workdir", str(tmp_path / "wd")]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


def test_run_refuses_to_restart_over_a_run_with_checkpoints(tmp_path, capsys):
    from launcher.commands.run import check_resume
    from launcher.errors import LauncherError

    run = RunFolder(tmp_path / "r", "job")
    config = {"config": {"name": "job", "process": []}}
    with pytest.raises(LauncherError, match="nothing to resume"):
        check_resume(run, True, config, accept_changes=False)
    run.job_dir.mkdir(parents=True)
    (run.job_dir / "job_000000010.safetensors").write_bytes(b"")
    with pytest.raises(LauncherError, match="--resume"):
        check_resume(run, False, config, accept_changes=False)
    run.config.write_text(yaml.safe_dump(config))
    check_resume(run, True, config, accept_changes=False)
    assert "resuming from job_000000010.safetensors" in capsys.readouterr().out


def test_repo_presets_are_the_ones_documented():
    docs = (REPO_ROOT / "README.md").read_text() + (REPO_ROOT / "docs" / "presets.md").read_text()
    for preset in PRESETS_DIR.glob("*.yaml"):
        assert preset.name in docs, f"neither README nor docs/presets.md documents {preset.name}"
