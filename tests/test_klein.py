"""FLUX.2 klein: its presets need the target upstream-main, are refused in one line on a checkout
without klein, and carry the trainer's own klein shapes."""

import ast
import re
from pathlib import Path

import pytest

from flux2_contract.families import KLEIN_4B, KLEIN_9B
from launcher.cli import main
from launcher.errors import LauncherError
from launcher.runs.presets import PRESETS_DIR, load_preset
from launcher.runs.vocabulary import read_vocabulary

KLEIN = {family.arch: family for family in (KLEIN_4B, KLEIN_9B)}
KLEIN_PRESETS = sorted(path.stem for path in PRESETS_DIR.glob("klein*.yaml"))
FLUX2_CLASS = 'class Flux2Model:\n    arch = "flux2"\n'
KLEIN_CLASSES = 'class Klein4B:\n    arch = "flux2_klein_4b"\n\nclass Klein9B:\n    arch = "flux2_klein_9b"\n'


def fake_trainer(root: Path, with_klein: bool) -> Path:
    """A checkout as the vocabulary reads it: the FLUX.2 model class, with or without klein's."""
    folder = root / "extensions_built_in" / "diffusion_models" / "flux2"
    folder.mkdir(parents=True)
    (root / "toolkit").mkdir()
    (folder / "flux2_model.py").write_text(FLUX2_CLASS, encoding="utf-8")
    if with_klein:
        (folder / "flux2_klein_model.py").write_text(KLEIN_CLASSES, encoding="utf-8")
    return root


def test_there_is_a_nvidia_and_an_amd_preset_for_each_klein_size():
    assert KLEIN_PRESETS == ["klein4b_512", "klein4b_amd_512", "klein9b_512", "klein9b_amd_512"]
    for name in KLEIN_PRESETS:
        preset = load_preset(name)
        model = preset.config["config"]["process"][0]["model"]
        assert model["arch"] in KLEIN and KLEIN[model["arch"]].target == "upstream-main"
        assert model["model_kwargs"]["flux2_params"] == KLEIN[model["arch"]].shape, name
        assert model["qtype"] == "auto" and model["model_kwargs"]["memory_plan"] == "auto", name
        assert preset.settings["platform"] == ("rocm" if "_amd_" in name else "cuda"), name


@pytest.mark.parametrize("name", KLEIN_PRESETS)
def test_a_klein_preset_on_a_checkout_without_klein_names_the_target_in_one_line(tmp_path, name):
    vocabulary = read_vocabulary(fake_trainer(tmp_path, with_klein=False))
    with pytest.raises(LauncherError) as caught:
        load_preset(name, vocabulary)
    lines = [line for line in str(caught.value).splitlines() if "model.arch" in line]
    assert len(lines) == 1, str(caught.value)
    assert "needs the trainer target upstream-main" in lines[0]
    assert "python -m launcher setup --target upstream-main" in lines[0]


@pytest.mark.parametrize("name", KLEIN_PRESETS)
def test_a_klein_preset_passes_on_a_checkout_with_klein(tmp_path, name):
    vocabulary = read_vocabulary(fake_trainer(tmp_path, with_klein=True))
    assert vocabulary.arches == {"flux2", "flux2_klein_4b", "flux2_klein_9b"}
    assert load_preset(name, vocabulary).name.startswith("flux2_klein")


def test_the_flux2_presets_need_no_klein(tmp_path):
    vocabulary = read_vocabulary(fake_trainer(tmp_path, with_klein=False))
    assert load_preset("7900xtx_512", vocabulary).name == "flux2_7900xtx_512"


def test_the_smallest_card_streams_only_the_9b():
    """On paper (cards.csv), an 8 GB card holds the whole 4-bit klein 4B and streams part of the 9B."""
    from launcher.selftest import cards

    smallest = {card.preset: cards.streams(card) for card in cards.CARDS
                if card.preset.startswith("klein") and card.vram_gib == 8}
    assert smallest == {"klein4b_512": False, "klein9b_512": True}


def klein_params(model_source: str) -> dict:
    """{class name: its field defaults} of the Klein*Params dataclasses of the trainer's src/model.py."""
    found = {}
    for node in ast.parse(model_source).body:
        if isinstance(node, ast.ClassDef) and re.fullmatch(r"Klein\d+BParams", node.name):
            fields = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and item.value is not None:
                    value = item.value
                    if isinstance(value, ast.Call):  # field(default_factory=lambda: [...])
                        value = value.keywords[0].value.body
                    fields[item.target.id] = ast.literal_eval(value)
            found[node.name] = fields
    return found


@pytest.mark.trainer
def test_the_klein_shapes_are_the_trainer_s(installed_workdirs):
    trainer = installed_workdirs("upstream-main").trainer
    source = (trainer / "extensions_built_in/diffusion_models/flux2/src/model.py").read_text(encoding="utf-8")
    params = klein_params(source)
    for arch, name in (("flux2_klein_4b", "Klein4BParams"), ("flux2_klein_9b", "Klein9BParams")):
        expected = {key: value for key, value in params[name].items() if key != "use_guidance_embed"}
        assert KLEIN[arch].shape == expected, arch
    classes = (trainer / "extensions_built_in/diffusion_models/flux2/flux2_klein_model.py").read_text(encoding="utf-8")
    for model in KLEIN.values():
        assert f'flux2_te_filename: str = "{model.transformer_file}"' in classes
        assert f'flux2_klein_te_path: str = "{model.text_encoder.hub_id}"' in classes


@pytest.mark.trainer
def test_the_locked_targets_are_the_ones_the_table_names(installed_workdirs):
    """The fork's checkout has no klein, upstream-main's has both sizes."""
    fork = read_vocabulary(installed_workdirs("amd-fork").trainer).arches
    upstream = read_vocabulary(installed_workdirs("upstream-main").trainer).arches
    assert not set(KLEIN) & fork and set(KLEIN) <= upstream


@pytest.mark.trainer
def test_run_refuses_a_klein_preset_on_the_fork_before_any_work(installed_workdirs, tmp_path, capsys):
    workdir = installed_workdirs("amd-fork").root
    assert main(["run", "klein4b_512", "--dry-run", "--workdir", str(workdir), "--output", str(tmp_path / "out"),
                 "--model-dir", str(tmp_path / "m"), "--text-encoder", str(tmp_path / "t"),
                 "--dataset", str(tmp_path / "d")]) != 0
    err = capsys.readouterr().err
    assert "needs the trainer target upstream-main" in err and not (tmp_path / "out").exists()
