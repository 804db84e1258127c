"""Nothing round-trips: once load_model has placed the transformer, nothing moves it again.

Trains the tiny preset for one step with the training device set to cpu:0 (see
record_model_moves.py, which counts every move of the transformer or the VAE after placement)
on a fresh copy of the dataset: the first launch encodes every latent, so the VAE goes to the
device for that and comes back; the relaunch finds every latent and embedding cached, and
nothing moves at all. With `stay_placed: false` the trainer's device-state presets park the
transformer on the CPU for the dataset caches and bring it back, as they always did: the same
recorder sees that round trip, so the checks can fail. With every item a cached latent, the
dataloader reads them in the trainer's process (no worker forked from it) unless
`cached_data_in_process: false`.
"""

import shutil

import pytest
from test_resident_training import record_moves, workdir  # noqa: F401  (the module fixture)

pytestmark = pytest.mark.patch("the-placed-transformer-stays")


def moves(events: list[dict], part: str) -> list[dict]:
    names = [e["event"] for e in events]
    assert names.count("placed") == 1 and "train_step" in names[names.index("placed"):], names
    return [e for e in events if e["event"] == "move" and e["part"] == part]


@pytest.fixture
def fresh_dataset(workdir, tmp_path):  # noqa: F811
    """A copy of the tiny dataset without any cached latent or caption embedding."""
    from launcher.envs.workdir import venv_python
    from launcher.runs import tiny

    manifest = tiny.ensure_assets(workdir.assets / "tiny", workdir.trainer, venv_python(workdir.venv))
    copy = tmp_path / "dataset"
    shutil.copytree(manifest["dataset"], copy, ignore=shutil.ignore_patterns("_*_cache"))
    return copy


def test_the_transformer_stays_placed_and_the_vae_moves_only_to_encode(workdir, tmp_path, fresh_dataset):  # noqa: F811
    first, log = record_moves(workdir, tmp_path, resident=True, text_phase=True, dataset=fresh_dataset, run="first")
    assert "Caching latents" in log
    assert moves(first, "transformer") == [], "the transformer moved after placement"
    vae = [(e["to"], e["caller"]) for e in moves(first, "vae")]
    assert [to for to, _ in vae] == ["cpu:0", "cpu"], vae  # there to encode the latents, then back

    relaunch, log = record_moves(workdir, tmp_path, resident=True, text_phase=True, dataset=fresh_dataset,
                               run="relaunch")
    assert moves(relaunch, "transformer") == [] and moves(relaunch, "vae") == [], relaunch
    # every item a cached latent: no dataloader worker is forked from the trainer
    assert [e["num_workers"] for e in relaunch if e["event"] == "dataloader"] == [0], relaunch


def test_switched_off_the_caches_round_trip_the_transformer(workdir, tmp_path, fresh_dataset):  # noqa: F811
    events, _ = record_moves(workdir, tmp_path, resident=True, text_phase=True, dataset=fresh_dataset,
                             model_kwargs={"stay_placed": False, "cached_data_in_process": False})
    trips = [(e["to"], e["caller"]) for e in moves(events, "transformer")]
    assert ("cpu", "set_device_state") in trips and ("cpu:0", "set_device_state") in trips, trips
    assert [e["num_workers"] for e in events if e["event"] == "dataloader"] == [2], events  # the dataset's
