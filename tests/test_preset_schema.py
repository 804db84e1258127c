"""The preset schema: every bad value is named with its key path, the value, what is allowed
and the closest known key, before anything heavy; a fuzz test shows nothing else escapes."""

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.cli import main
from launcher.errors import LauncherError
from launcher.runs.presets import PRESETS_DIR, load_preset, read_preset
from launcher.runs import schema, schema_nodes
from launcher.runs.schema import Vocabulary, check_preset

SHIPPED = sorted(PRESETS_DIR.glob("*.yaml"))


def merged(path) -> dict:
    """A shipped preset as the schema sees it: laid over the presets it inherits."""
    return read_preset(str(path)).data


def keys_used_by_shipped_presets() -> dict[str, set[str]]:
    """{section: keys}: a trainer that reads exactly what the shipped presets set."""
    keys: dict[str, set[str]] = {"process": set(), "logging": set()}
    for path in SHIPPED:
        for process in merged(path)["config"]["process"]:
            keys["process"] |= set(process)
            for section, block in process.items():
                for item in block if isinstance(block, list) else [block]:
                    if isinstance(item, dict):
                        keys.setdefault(section, set()).update(item)
    return keys


# What a trainer checkout and venv would report (the real tables: test_vocabulary.py).
TRAINER = Vocabulary(
    section_keys=keys_used_by_shipped_presets(),
    model_kwargs={key for path in SHIPPED
                  for process in merged(path)["config"]["process"]
                  for key in process["model"].get("model_kwargs", {})},
    qtypes={"uint4", "uint3", "uint8", "int4_fused", "qint4", "float8"},
    optimizers={"adamw", "adamw8bit", "adam"}, optimizer_prefixes={"prodigy"},
    network_types={"lora", "lokr"}, dtypes={"bf16", "fp16", "float32"}, jobs={"extension", "train"},
)
def shipped(name="7900xtx_512.yaml") -> dict:
    return merged(PRESETS_DIR / name)


def process(preset: dict) -> dict:
    return preset["config"]["process"][0]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_presets_pass(path):
    assert check_preset(merged(path), TRAINER) == []


CASES = [
    # (change, the message's fragments)
    (lambda p: process(p)["train"].update(steps="ten"),
     ["config.process[0].train.steps = 'ten': not a whole number", "allowed: a whole number >= 1"]),
    (lambda p: process(p)["train"].update(batch_size=0),
     ["config.process[0].train.batch_size = 0: out of range", "a whole number >= 1"]),
    (lambda p: process(p)["train"].update(lr=-1),
     ["config.process[0].train.lr = -1: out of range", "a number > 0"]),
    (lambda p: process(p)["train"].update(lr="1e-4"),
     ["train.lr = '1e-4': text, not a number", "write 1.0e-4"]),
    (lambda p: process(p)["model"].update(qtype="int3"),
     ["config.process[0].model.qtype = 'int3': not one of the allowed values", "uint4", "did you mean `uint3`?"]),
    (lambda p: process(p)["train"].update(optimizer="adamw9bit"),
     ["train.optimizer = 'adamw9bit'", "adamw8bit", "prodigy...", "did you mean `adamw8bit`?"]),
    (lambda p: process(p)["network"].update(type="lokrr"), ["network.type = 'lokrr'", "did you mean `lokr`?"]),
    (lambda p: process(p)["save"].update(dtype="bf61"), ["save.dtype = 'bf61'", "bf16"]),
    (lambda p: process(p)["datasets"][0].update(resolution=[512, 100]),
     ["datasets[0].resolution[1] = 100: not a multiple of 16 (use 96 or 112)"]),
    (lambda p: process(p)["datasets"][0].update(resolution=0), ["datasets[0].resolution[0] = 0: out of range"]),
    (lambda p: process(p)["save"].update(save_every=0), ["save.save_every = 0: out of range"]),
    (lambda p: process(p)["model"]["model_kwargs"].update(streamed_loadr=False),
     ["model.model_kwargs.streamed_loadr: unknown key (the trainer would silently ignore it)",
      "did you mean `streamed_loader`?"]),
    (lambda p: process(p)["model"]["model_kwargs"].update(streamed_loader="yes"),
     ["model_kwargs.streamed_loader = 'yes': not true/false"]),
    (lambda p: process(p)["model"]["model_kwargs"].update(quantize_device="cuda"),
     ["model_kwargs.quantize_device = 'cuda'", "allowed: cpu | gpu"]),
    (lambda p: p["launcher"]["watchdog"].update(enabeld=True),
     ["launcher.watchdog.enabeld: unknown key (not a setting); did you mean `enabled`?"]),
    (lambda p: p["launcher"]["watchdog"].update(interval_s=0), ["launcher.watchdog.interval_s = 0: out of range"]),
    (lambda p: p["launcher"]["watchdog"].update(source="rocm_smi"),
     ["launcher.watchdog.source = 'rocm_smi'", "did you mean `rocm-smi`?"]),
    (lambda p: p["launcher"]["telemetry"].update(interval_s=-5), ["launcher.telemetry.interval_s = -5"]),
    (lambda p: p["launcher"].update(allocator="expandable"), ["launcher.allocator = 'expandable'",
                                                             "did you mean `expandable_segments`?"]),
    (lambda p: p.update(config="flux"), ["config = 'flux': not a mapping"]),
    (lambda p: p["config"].update(process={"type": "sd_trainer"}), ["config.process = {'type': 'sd_trainer'}: not a list",
                                                                    "a list of at least 1 item, each a mapping"]),
    (lambda p: p.update(launcher=5), ["launcher = 5: not a mapping"]),
    (lambda p: p["launcher"].update(env=["HF_HUB_OFFLINE=1"]), ["launcher.env = ['HF_HUB_OFFLINE=1']: not a mapping"]),
    (lambda p: p["launcher"].update(env={"HF_HUB_OFFLINE": {"b": 1}}), ["launcher.env.HF_HUB_OFFLINE = {'b': 1}: not a single value"]),
    (lambda p: p["config"].update(name="../outside"), ["config.name = '../outside'", "a plain folder name"]),
    (lambda p: p["config"].update(name="a/b"), ["config.name = 'a/b'"]),
    (lambda p: p["config"].update(name=".."), ["config.name = '..'"]),
    (lambda p: p["config"].update(name="con"), ["config.name = 'con'", "a name Windows keeps for a device"]),
    (lambda p: p["config"].update(name="Nul.lora"), ["config.name = 'Nul.lora'", "Windows keeps for a device"]),
    (lambda p: p["config"].update(name="COM1 "), ["config.name = 'COM1 '"]),
    (lambda p: p["config"].update(name="lpt\u00b9"), ["Windows keeps for a device"]),
    (lambda p: p["config"].update(name="\u65e5" * 80), ["240 bytes in UTF-8, over 200"]),
    (lambda p: p.update(job="extensoin"), ["job = 'extensoin'", "did you mean `extension`?"]),
    (lambda p: p["config"].pop("name"), ["config.name is missing"]),
    (lambda p: process(p).update(datasets=[]), ["config.process[0].datasets = []: too few items"]),
    (lambda p: process(p).update(trian={}), ["config.process[0].trian: unknown key", "did you mean `train`?"]),
]


@pytest.mark.parametrize("change, fragments", CASES, ids=[c[1][0][:50] for c in CASES])
def test_each_bad_value_is_named(change, fragments):
    preset = shipped()
    change(preset)
    problems = check_preset(preset, TRAINER)
    assert len(problems) == 1, problems
    for fragment in fragments:
        assert fragment in problems[0], problems[0]


@pytest.mark.parametrize("value, fault", [("ten", "not a whole number"), (2.5, "not a whole number"),
                                          (True, "not a whole number"), (0, "out of range")])
def test_a_trainer_key_and_a_catalogue_setting_name_one_fault_alike(value, fault):
    """train.steps is the schema's own, launcher.gpus the catalogue's: one rule and one wording for both."""
    preset = shipped()
    process(preset)["train"].update(steps=value)
    preset["launcher"]["gpus"] = value
    found = check_preset(preset, TRAINER)
    assert [item.split(": ", 1)[1].split(";")[0] for item in found] == [fault, fault], found


def test_null_is_a_catalogue_settings_default_but_no_value_for_the_schemas_own_keys():
    preset = shipped()
    process(preset)["train"].update(steps=None, lr=None, optimizer=None, gradient_checkpointing=None)
    preset["launcher"]["gpus"] = None
    assert {item.split(" = ")[0].rsplit(".", 1)[1] + ": " + item.split(": ", 1)[1].split(";")[0]
            for item in check_preset(preset, TRAINER)} == {
        "steps: not a whole number", "lr: not a number", "optimizer: not a non-empty text",
        "gradient_checkpointing: not true/false"}, "launcher.gpus: null is its default"


def test_without_the_trainer_only_its_tables_go_unchecked():
    preset = shipped()
    process(preset)["model"].update(qtype="int3")
    process(preset)["model"]["model_kwargs"].update(streamed_loadr=False)
    process(preset)["train"].update(steps="ten")
    assert [p.split(":")[0] for p in check_preset(preset)] == ["config.process[0].train.steps = 'ten'"]


def test_a_preset_file_with_several_problems_lists_them_all_and_starts_nothing(tmp_path, capsys):
    preset = shipped("tiny.yaml")
    process(preset)["train"].update(steps="ten", batch_size=0)
    preset["launcher"]["env"] = ["x"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(preset), encoding="utf-8")
    assert main(["run", str(path), "--workdir", str(tmp_path / "wd")]) == 2
    err = capsys.readouterr().err
    assert f"{path} has 3 problems; nothing was started" in err
    assert "train.steps = 'ten'" in err and "train.batch_size = 0" in err and "launcher.env = ['x']" in err
    assert not (tmp_path / "wd").exists(), "nothing is written for a bad preset"


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text\n", "", "config: [\n", "\xff\xfe",
                                  "job: " + "[" * 50_000 + "]" * 50_000, "job: " + "9" * 5000],
                         ids=["list", "text", "empty", "unclosed", "not UTF-8", "nested", "huge int"])
def test_files_that_are_not_presets(tmp_path, text):
    path = tmp_path / "odd.yaml"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(LauncherError, match=str(path.name)):
        load_preset(str(path))


# -- fuzz: any mutation of a shipped preset is either accepted or refused with messages -----------

json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(10**400), 10**400) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def paths_of(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths_of(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from paths_of(value, prefix + (index,))


@st.composite
def mutated_presets(draw):
    preset = merged(draw(st.sampled_from(SHIPPED)))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(paths_of(preset))))
        if not path:
            preset = draw(json_like)
            continue
        parent = preset
        for step in path[:-1]:
            parent = parent[step]
        if draw(st.booleans()) or not isinstance(parent, dict):
            parent[path[-1]] = draw(json_like)
        else:
            parent[draw(st.text(max_size=8))] = parent.pop(path[-1])
    return preset


@settings(max_examples=400, deadline=None)
@given(mutated_presets(), st.booleans())
def test_any_mutation_gives_messages_never_an_exception(preset, with_trainer):
    problems = check_preset(preset, TRAINER if with_trainer else Vocabulary())
    assert isinstance(problems, list) and all(isinstance(p, str) and p for p in problems)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutated_presets())
def test_load_preset_raises_only_its_own_error(tmp_path, preset):
    path = tmp_path / "mutant.yaml"
    path.write_text(yaml.safe_dump(preset, allow_unicode=True), encoding="utf-8")
    try:
        loaded = load_preset(str(path))
    except LauncherError as error:
        assert "mutant.yaml" in str(error)
        return
    assert isinstance(loaded.name, str) and loaded.config["config"]["process"]


def numeric_values(spec, path: str):
    """(key path, Value) of every number the schema checks, in every block and list, walked on the specs."""
    if isinstance(spec, schema_nodes.Value):
        if spec.setting.kind in ("int", "number"):
            yield path, spec
        return
    for attribute in ("keys", "item", "inner", "extra"):
        inner = getattr(spec, attribute, None)
        if isinstance(inner, dict):
            for key, child in inner.items():
                yield from numeric_values(child, f"{path}.{key}")
        elif isinstance(inner, schema_nodes.Spec):
            yield from numeric_values(inner, path)


ALL_NUMBERS = [*numeric_values(schema.PROCESS, "config.process[]"), *numeric_values(schema.launcher_block(), "launcher")]


def test_the_walk_reaches_every_block():
    paths = {path for path, _ in ALL_NUMBERS}
    assert {"config.process[].train.steps", "launcher.watchdog.rank_stall_s", "launcher.telemetry.interval_s",
            "launcher.watchdog.baseline.power_w", "config.process[].model.model_kwargs.vram_margin_gib"} <= paths


@pytest.mark.parametrize("path, spec", ALL_NUMBERS, ids=[path for path, _ in ALL_NUMBERS])
def test_every_number_has_a_lower_and_an_upper_bound_and_refuses_null(path, spec):
    setting = spec.setting
    assert setting.maximum is not None, f"{path}: no upper bound"
    assert setting.minimum is not None or setting.above is not None, f"{path}: no lower bound"
    problems = list(spec.check(setting.maximum * 10 + 1, path, TRAINER))
    assert problems and "out of range" in problems[0], problems
    if not spec.null_is_default:  # a catalogue setting's null is its default; no other number takes null
        assert list(spec.check(None, path, TRAINER)), f"{path} takes null"
