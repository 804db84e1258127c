"""Preset loading and rendering: the launcher block is split off, machine paths are filled in."""

import re
from pathlib import Path

import pytest
import yaml

from launcher.cli import main
from launcher.errors import LauncherError
from launcher.runs.inheritance import INHERITS_KEY, leaves
from launcher.runs.presets import PRESETS_DIR, find_preset, load_preset, read_preset, render
from launcher.runs.yaml_files import load_yaml

MANIFEST = {
    "name_or_path": "/assets/tiny",
    "dataset": "/assets/tiny/dataset",
    "resolution": 128,
    "model_kwargs": {"flux2_params": {"hidden_size": 64}, "text_encoder_path": "/assets/tiny/te"},
}


def test_shipped_tiny_preset_is_found_by_name():
    assert find_preset("tiny").name == "tiny.yaml"


def test_unknown_preset_names_the_shipped_ones():
    with pytest.raises(LauncherError, match="tiny"):
        find_preset("no-such-preset")


def test_tiny_preset_splits_launcher_block():
    preset = load_preset("tiny")
    assert preset.tiny and preset.name == "tiny_flux2"
    assert preset.env["HF_HUB_OFFLINE"] == "1"
    assert "launcher" not in preset.config


def test_render_fills_run_folder_and_tiny_assets(tmp_path):
    preset = load_preset("tiny")
    config = render(preset, tmp_path / "runs" / "x", MANIFEST)
    process = config["config"]["process"][0]
    assert Path(process["training_folder"]) == (tmp_path / "runs" / "x").resolve()
    assert process["model"]["name_or_path"] == "/assets/tiny"
    assert process["model"]["model_kwargs"]["flux2_params"] == {"hidden_size": 64}
    assert process["datasets"][0]["folder_path"] == "/assets/tiny/dataset"
    assert process["datasets"][0]["resolution"] == [128]
    assert preset.config["config"]["process"][0]["model"]["model_kwargs"] == {}  # preset untouched


def test_preset_comments_carry_no_benchmark_figures():
    """Figures drift; a preset comment may point to bench/RESULTS.md, not quote it."""
    figure = re.compile(r"\d\s*(GiB|MiB|s/it|s/step|it/s|TFLOP|ms\b|x bf16)")
    found = [f"{path.name}:{number}: {line.strip()}"
             for path in sorted((Path(__file__).resolve().parents[1] / "presets").glob("*.yaml"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if "#" in line and figure.search(line.split("#", 1)[1])]
    assert not found, "benchmark figures in preset comments (point to bench/RESULTS.md instead):\n" + "\n".join(found)


# -- inheritance ---------------------------------------------------------------------------------------

CARD_PRESETS = [path.stem for path in sorted(PRESETS_DIR.glob("*.yaml")) if INHERITS_KEY in load_yaml(path)]


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_every_card_preset_inherits_and_the_base_and_tiny_stand_alone():
    assert set(CARD_PRESETS) == {path.stem for path in PRESETS_DIR.glob("*.yaml")} - {"base_512", "tiny"}
    assert load_preset("base_512").files == (PRESETS_DIR / "base_512.yaml",)


@pytest.mark.parametrize("name", CARD_PRESETS)
def test_a_card_preset_is_its_parent_plus_exactly_what_it_lists(name):
    """The file is its parent with the values it writes set, and each value it writes is a change."""
    own = load_yaml(PRESETS_DIR / f"{name}.yaml")
    expected = read_preset(own.pop(INHERITS_KEY)).data
    for path, value in leaves(own):
        *parents, last = re.split(r"\.|(?=\[)", path)
        target = expected
        for part in parents:
            target = target[int(part[1:-1])] if part.startswith("[") else target.setdefault(part, {})  # a new block
        key = int(last[1:-1]) if last.startswith("[") else last
        assert target.get(key) != value, f"{name} repeats its parent's {path}: {value!r}"
        target[key] = value
    assert read_preset(name).data == expected


def test_no_two_shipped_presets_are_one_configuration():
    """One file per real variation: `qtype: auto` and the memory plan adapt to the card, so no preset
    differs from another only in its run name."""
    configs = {}
    for path in PRESETS_DIR.glob("*.yaml"):
        preset = load_preset(path.stem)
        config = {**preset.config, "config": {**preset.config["config"], "name": None}}
        configs.setdefault(yaml.safe_dump({**config, "launcher": preset.settings}), []).append(path.stem)
    assert [names for names in configs.values() if len(names) > 1] == []


def test_an_old_name_is_refused_where_no_row_names_it():
    with pytest.raises(LauncherError, match="no preset 'rtx2080_512'"):
        load_preset("rtx2080_512")


def test_the_base_plans_streaming_on_smaller_cards():
    model = load_preset("base_512").config["config"]["process"][0]["model"]
    assert model["qtype"] == "auto" and model["model_kwargs"]["memory_plan"] == "auto"


def test_the_8gb_preset_plans_the_full_model_on_an_8gb_card():
    """What an 8 GB card leaves free under a desktop holds the plan's minimum, streaming nearly
    every block: the trainer's own planner, as `run --dry-run` asks it."""
    from launcher.runs import memory_plan

    preset = load_preset("rtx8gb_512")
    assert preset.files == (PRESETS_DIR / "base_512.yaml",)
    plan = memory_plan.plan_for(preset.config["config"]["process"][0], 8 - memory_plan.DESKTOP_GIB)
    assert len(plan.blocks) == 56 and len(plan.streamed()) >= 50


PARENT = """job: extension
config:
  name: parent
  process:
    - type: sd_trainer
      datasets:
        - caption_ext: txt
          resolution: [512, 768]
      train:
        steps: 100
        lr: 0.0001
      model:
        qtype: uint4
        model_kwargs: {memory_plan: auto}
      sample:
        prompts: [a, b]
launcher:
  env: {HF_HUB_OFFLINE: "1"}
"""


def test_mappings_merge_lists_of_mappings_by_index_other_values_replace(tmp_path):
    write(tmp_path, "parent.yaml", PARENT)
    child = write(tmp_path, "child.yaml", """inherits: parent.yaml
config:
  name: child
  process:
    - datasets:
        - resolution: [448]
      train: {lr: 0.0002}
      model: {model_kwargs: {stream_mode: serialized}}
      sample: {prompts: [c]}
launcher:
  env: {TOKENIZERS_PARALLELISM: "false"}
""")
    data = read_preset(str(child)).data
    process = data["config"]["process"][0]
    assert data["config"]["name"] == "child" and data["job"] == "extension"
    assert process["datasets"] == [{"caption_ext": "txt", "resolution": [448]}]
    assert process["train"] == {"steps": 100, "lr": 0.0002}
    assert process["model"] == {"qtype": "uint4", "model_kwargs": {"memory_plan": "auto", "stream_mode": "serialized"}}
    assert process["sample"]["prompts"] == ["c"]
    assert data["launcher"]["env"] == {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert INHERITS_KEY not in data


def test_a_chain_and_a_preset_of_your_own_inheriting_a_shipped_one(tmp_path):
    mine = write(tmp_path, "mine.yaml", "inherits: rtx16gb_512\nconfig:\n  name: my_lora\n")  # an old name
    deeper = write(tmp_path, "more/steps.yaml", "inherits: ../mine.yaml\nconfig:\n  process:\n"
                                                 "    - train: {steps: 3000}\n")
    preset = load_preset(str(deeper))
    assert [file.name for file in preset.files] == ["steps.yaml", "mine.yaml", "base_512.yaml"]
    assert preset.name == "my_lora" and preset.config["config"]["process"][0]["train"]["steps"] == 3000
    assert load_preset(str(mine)).config["config"]["process"][0]["model"]["qtype"] == "auto"


def test_a_file_beside_the_preset_comes_before_a_shipped_name(tmp_path):
    write(tmp_path, "rtx4090_512.yaml", PARENT)
    child = write(tmp_path, "child.yaml", "inherits: rtx4090_512\n")
    assert read_preset(str(child)).files[1] == tmp_path / "rtx4090_512.yaml"


@pytest.mark.parametrize("files, fragments", [
    ({"a.yaml": "inherits: a\n"}, ["a.yaml inherits in a circle", "a.yaml -> ", "remove the `inherits:` line"]),
    ({"a.yaml": "inherits: b\n", "b.yaml": "inherits: c.yaml\n", "c.yaml": "inherits: a\n"},
     ["a.yaml inherits in a circle", "a.yaml -> ", "b.yaml -> ", "c.yaml -> "]),
    ({"a.yaml": "job: extension\ninherits: nowhere\n"},
     ["a.yaml, line 2: inherits = 'nowhere': no such preset", "base_512", "fix the name or the path"]),
    ({"a.yaml": "inherits: 5\n"}, ["a.yaml, line 1: inherits = 5: not a preset", "a shipped preset's name"]),
    ({"a.yaml": "inherits: b\n", "b.yaml": "- a list\n"}, ["a.yaml inherits ", "b.yaml, which holds a list,",
                                                         "not a preset's mapping"]),
    ({"a.yaml": "inherits: b\n", "b.yaml": "a key file's one line\n"},
     ["b.yaml, which holds a line of text, not a preset's mapping"]),
    ({"a.yaml": "inherits: b\n", "b.yaml": "job: [\n"}, ["b.yaml is not valid YAML", "(inherited by ", "a.yaml)"]),
    ({"a.yaml": "inherits: " + "x" * 5000 + "\n"}, ["a.yaml, line 1: inherits = 'xxx", "no such preset"]),
], ids=["itself", "a circle of three", "missing parent", "not text", "parent not a mapping",
        "parent holds text, never shown", "parent not YAML",
        "name too long"])
def test_a_bad_inherits_is_named_with_its_files(tmp_path, files, fragments):
    for name, text in files.items():
        write(tmp_path, name, text)
    with pytest.raises(LauncherError) as error:
        load_preset(str(tmp_path / "a.yaml"))
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)


def test_a_problem_names_the_file_and_line_that_set_the_key(tmp_path):
    parent = write(tmp_path, "parent.yaml", "inherits: base_512\nconfig:\n  process:\n    - train: {lr: -1}\n")
    child = write(tmp_path, "child.yaml", "inherits: parent.yaml\nconfig:\n  process:\n"
                                          "    - train: {steps: ten}\n")
    with pytest.raises(LauncherError) as error:
        load_preset(str(child))
    message = str(error.value)
    assert f"{child} has 2 problems" in message
    assert "\n  line 4: config.process[0].train.steps = 'ten'" in message
    line = parent.read_text(encoding="utf-8").splitlines().index("    - train: {lr: -1}") + 1
    assert f"\n  {parent}, line {line}: config.process[0].train.lr = -1" in message


def test_a_value_replaced_by_the_child_is_no_longer_the_parents_problem(tmp_path):
    write(tmp_path, "parent.yaml", read_text("base_512").replace("resolution: [512]", "resolution: [512, 100]"))
    child = write(tmp_path, "child.yaml", "inherits: parent.yaml\nconfig:\n  process:\n    - datasets:\n"
                                          "        - resolution: [500]\n")
    with pytest.raises(LauncherError) as error:
        load_preset(str(child))
    assert "has a problem" in str(error.value)
    assert "line 5: config.process[0].datasets[0].resolution[0] = 500" in str(error.value)


def read_text(name: str) -> str:
    return (PRESETS_DIR / f"{name}.yaml").read_text(encoding="utf-8")


def test_the_sha_covers_the_parent_and_not_the_comments(tmp_path):
    parent = write(tmp_path, "parent.yaml", read_text("base_512"))
    child = write(tmp_path, "child.yaml", "inherits: parent.yaml\n")
    first = load_preset(str(child)).sha256
    parent.write_text("# a comment\n" + read_text("base_512"), encoding="utf-8")
    assert load_preset(str(child)).sha256 == first
    parent.write_text(read_text("base_512").replace("steps: 2000", "steps: 2001"), encoding="utf-8")
    assert load_preset(str(child)).sha256 != first
    assert load_preset("rtx4090_512").sha256 != load_preset("base_512").sha256  # the name differs


# -- `python -m launcher presets` ------------------------------------------------------------------------


def test_the_listing_names_every_shipped_preset_with_its_card_and_changes(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for path in PRESETS_DIR.glob("*.yaml"):
        assert re.search(rf"^{re.escape(path.stem)} +\d+ px +batch \d  \S", out, re.M), path.stem
    assert "RTX 4090, RTX 3090, RTX 4060 Ti 16 GB" in out and "RTX 5060 (24 or 16 or 12 or 8 GB)" in out
    assert re.search(r"^7900xtx_448_bs2 +448 px +batch 2  RX 7900 XTX .*\n +inherits 7900xtx_512, sets "
                     r"datasets\[0\]\.resolution=\[448\] train\.batch_size=2 train\.lr=0\.000141421$", out, re.M)
    assert re.search(r"^7900xtx_768 .*\n +inherits 7900xtx_512, sets datasets\[0\]\.resolution=\[768\]$", out, re.M)


def test_the_docs_show_the_listing_as_it_is(capsys):
    assert main(["presets"]) == 0
    shown = capsys.readouterr().out.split("\n\n")[0]
    docs = (PRESETS_DIR.parent / "docs" / "presets.md").read_text(encoding="utf-8")
    assert f"$ python -m launcher presets\n{shown}\n```" in docs, "docs/presets.md: paste the new listing"


def test_the_docs_example_of_a_preset_of_your_own_loads(tmp_path):
    docs = (PRESETS_DIR.parent / "docs" / "presets.md").read_text(encoding="utf-8")
    example = write(tmp_path, "my_lora.yaml", re.search(r"```yaml\n# my_lora.yaml\n(.*?)```", docs, re.S)[1])
    preset = load_preset(str(example))
    assert preset.name == "my_lora" and preset.files[1] == PRESETS_DIR / "base_512.yaml"
    assert preset.config["config"]["process"][0]["datasets"][0]["cache_latents_to_disk"] is True


def test_one_preset_in_full_with_the_file_of_each_value(capsys):
    assert main(["presets", "7900xtx_768"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# 7900xtx_768.yaml, which inherits 7900xtx_512.yaml, which inherits base_512.yaml\n")
    assert yaml.safe_load(out) == read_preset("7900xtx_768").data
    assert re.search(r"^      qtype: auto +# base_512\.yaml:\d+$", out, re.M)
    assert re.search(r"^  name: flux2_7900xtx_768 +# 7900xtx_768\.yaml:\d+$", out, re.M)
    assert re.search(r"^        memory_plan: auto +# base_512\.yaml:\d+$", out, re.M)


def test_an_old_name_as_a_path_from_the_repository_runs_its_preset(monkeypatch, capsys):
    """`presets/rtx4090_512.yaml`, as README commands and users' scripts wrote it, from the checkout."""
    monkeypatch.chdir(PRESETS_DIR.parent)
    assert main(["presets", "presets/rtx4090_512.yaml"]) == 0
    assert capsys.readouterr().out.startswith("# rtx4090_512 is base_512 now (presets/cards.csv: RTX 4090, RTX 3090)")
    with pytest.raises(LauncherError, match="no preset 'elsewhere/rtx4090_512.yaml'"):
        load_preset("elsewhere/rtx4090_512.yaml")


def test_an_old_name_in_full_says_what_it_is_now(capsys):
    assert main(["presets", "rtx12gb_512"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# rtx12gb_512 is base_512 now (presets/cards.csv: RTX 3060 12 GB, RTX 4070, RTX 5070); "
                          "it trains in the run folder flux2_rtx12gb_512 as before\n# base_512.yaml\n")
    assert yaml.safe_load(out) == read_preset("rtx12gb_512").data
    assert re.search(r"^  name: flux2_rtx12gb_512 +# cards\.csv:\d+$", out, re.M)


def test_a_value_over_several_lines_is_shown_intact(tmp_path, capsys):
    mine = write(tmp_path, "mine.yaml", "inherits: 7900xtx_512\nconfig:\n  process:\n    - sample:\n        prompts:\n"
                                        "          - 'first line\n\n            second # not a comment'\n"
                                        f"          - {'a long prompt ' * 20}\n")
    assert main(["presets", str(mine)]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == read_preset(str(mine)).data
    assert out.startswith(f"# {mine}, which inherits 7900xtx_512.yaml, which inherits base_512.yaml\n")


def test_a_preset_with_problems_is_refused_before_it_is_shown(tmp_path, capsys):
    bad = write(tmp_path, "bad.yaml", "inherits: rtx4090_512\nconfig:\n  process:\n    - train: {steps: 0}\n")
    assert main(["presets", str(bad)]) == 2
    assert "line 4: config.process[0].train.steps = 0: out of range" in capsys.readouterr().err


def test_inherits_takes_a_preset_file_never_any_file_and_shows_no_secret(tmp_path):
    write(tmp_path, "credentials", "aws_secret_access_key: hunter2-SECRET\n")
    child = write(tmp_path, "child.yaml", "inherits: credentials\n")
    with pytest.raises(LauncherError) as refused:
        load_preset(str(child))
    assert "not a preset file (a preset ends in .yaml)" in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_an_inherited_yaml_of_unknown_keys_names_the_keys_never_their_values(tmp_path):
    write(tmp_path, "keys.yaml", "aws_secret_access_key: hunter2-SECRET\nconfig:\n  token: hunter3-SECRET\n")
    child = write(tmp_path, "child.yaml", "inherits: keys.yaml\n")
    with pytest.raises(LauncherError) as refused:
        load_preset(str(child))
    assert "aws_secret_access_key: unknown key" in str(refused.value)
    assert "SECRET" not in str(refused.value)
