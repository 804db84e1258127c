"""The settings catalogue (overlay/toolkit/settings.py): one table the launcher's schema, `run`'s
resolution, the trainer's readers and docs/options.md all come from."""

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher import decision, options_doc, resolve, trainer_rules
from launcher.runs import files, resume, schema_nodes
from launcher.runs.schema import MODEL_KWARGS, Vocabulary

ROOT = Path(__file__).resolve().parents[1]
settings = trainer_rules.settings()
DIRECT = re.compile(r'kwargs(?:\.get\(|\[)\s*"(\w+)"')
"""A setting read around the catalogue: `model_kwargs.get("key", ...)` or `model_kwargs["key"]`."""
READ = re.compile(r'\bread\(\s*[\w.]*kwargs,\s*"(\w+)"')


def test_docs_options_is_the_generated_page():
    assert options_doc.main(["--check"]) == 0, "run python -m launcher.options_doc"


def test_the_schema_checks_every_model_kwargs_setting_by_the_catalogues_rule():
    for name, item in settings.model_kwargs_settings().items():  # a spec of the schema's own would say otherwise
        if item.kind != "mapping":
            problems = list(MODEL_KWARGS.check({name: [1]}, "kw", Vocabulary()))
            assert len(problems) == 1 and problems[0].endswith(f"allowed: {item.allowed}"), (name, problems)
    problems = list(MODEL_KWARGS.check({"stream_mode": "fast", "int4_chunk_mib": 0}, "kw", Vocabulary()))
    assert any("kw.stream_mode = 'fast': not one of the allowed values; allowed: auto | serialized | overlapped" in p
               for p in problems), problems
    assert any("kw.int4_chunk_mib = 0: out of range" in p for p in problems), problems


def test_the_trainer_refuses_an_auto_that_run_resolves():
    for name in ("stream_mode", "compile_blocks", "w4a8_activations", "w4a8_gemm"):
        with pytest.raises(settings.SettingError, match=f"model_kwargs {name}: auto is resolved by"):
            settings.read({name: "auto"}, name)
    assert settings.read({}, "compile_blocks") is False and settings.read({"memory_plan": False}, "memory_plan") == "off"


def test_complete_writes_every_default_and_keeps_the_trainers_own_keys():
    done = settings.complete({"stream_mode": "overlapped", "trainer_key": 3})
    assert done["stream_mode"] == "overlapped" and done["trainer_key"] == 3
    assert done["quantize_device"] == "cpu" and "vram_budget_gib" not in done, "an unset default stays absent"


def added_lines() -> dict[str, str]:
    """{patch file name: the lines it adds}, both targets."""
    return {f"{patch.parent.name}/{patch.name}": "\n".join(line[1:] for line in patch.read_text(encoding="utf-8").splitlines()
                                                       if line.startswith("+") and not line.startswith("+++"))
            for patch in sorted(ROOT.glob("patches/*/*.patch"))}


def test_the_patches_read_settings_only_through_the_catalogue():
    """A patch reads a setting with `settings.read(model_kwargs, key)`: the catalogue's default and rule, never
    a literal default of its own (`model_kwargs.get(key, default)`) that could drift from it."""
    offenders = [f"{name}: {key}" for name, text in added_lines().items()
                 for key in DIRECT.findall(text) if key in settings.CATALOGUE]
    assert offenders == []
    read_keys = {key for text in added_lines().values() for key in READ.findall(text)}
    assert {"streamed_loader", "stay_placed", "allow_unquantized_block_linears", "flux2_params"} <= read_keys


def test_the_overlay_reads_settings_only_through_the_catalogue():
    offenders = [f"{path.name}: {key}" for path in ROOT.glob("overlay/toolkit/*.py")
                 for key in re.findall(r'kwargs\.get\("(\w+)"', path.read_text(encoding="utf-8"))
                 if key in settings.CATALOGUE]
    assert offenders == []


def test_the_trainer_reads_no_aitk_variable():
    """What `run` tells the trainer travels in the config: no overlay module or patch names an AITK_
    variable (a test's own interpreter wrapper, AITK_TEST_*, is not the trainer)."""
    texts = {**added_lines(), **{path.name: path.read_text(encoding="utf-8") for path in ROOT.glob("overlay/**/*.py")}}
    offenders = [f"{name}: {found}" for name, text in texts.items()
                 for found in re.findall(r"""["'](AITK_\w+)""", text) if not found.startswith("AITK_TEST_")]
    assert offenders == []


def test_run_writes_its_settings_into_the_config_and_keeps_the_presets_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(files.ENV_QUANT_CACHE_DIR, raising=False)  # `run`'s own shell may name another folder
    run = SimpleNamespace(root=tmp_path / "run", trainer_telemetry=tmp_path / "run" / "trainer-telemetry.jsonl")
    workdir = SimpleNamespace(quantized_cache=tmp_path / "wd" / "quantized", text_cache=tmp_path / "wd" / "text")
    written = decision.handed_over(run, SimpleNamespace(telemetry={"interval_s": 2.5}), 3, gpus=2)
    config = {"config": {"process": [{"model": {"model_kwargs": {"text_embedding_cache_dir": "mine",
                                                                 "telemetry_file": "elsewhere"}}}]}}
    config = files.hand_over(config, written, decision.cache_folders(workdir))
    kwargs = config["config"]["process"][0]["model"]["model_kwargs"]
    assert kwargs == {"text_embedding_cache_dir": "mine", "quantized_cache_dir": str(workdir.quantized_cache),
                      "telemetry_file": str(run.trainer_telemetry), "telemetry_interval_s": 2.5, "profile_steps": 3,
                      "profile_dir": str(run.root / "profile"), "rank_state_file": str(run.root / "rank-state.json")}
    for name in kwargs:
        assert settings.CATALOGUE[name].problem(kwargs[name]) is None, name
        assert settings.CATALOGUE[name].resume_may_change, f"{name}: `run` writes it anew at each launch"
    assert "rank_state_file" not in decision.handed_over(run, SimpleNamespace(telemetry={"interval_s": 2}), None, 1)


def test_a_new_model_key_needs_its_catalogue_line_its_reader_and_the_docs(monkeypatch):
    """A throwaway key, added as one catalogue line: the preset's schema checks it, `run` writes its
    default into the config, the trainer reads it with the catalogue's rule, a resume treats it by its
    flag, and the options page is stale until regenerated: nothing else is to be edited."""
    new = settings.Setting("throwaway_chunk", settings.MODEL_KWARGS, "int", 3, "a key no one reads", minimum=1)
    monkeypatch.setitem(settings.CATALOGUE, new.name, new)
    block = schema_nodes.Block(schema_nodes.catalogued(settings.MODEL_KWARGS, {}))
    problems = list(block.check({"throwaway_chunk": 0}, "kw", Vocabulary()))
    assert problems == ["kw.throwaway_chunk = 0: out of range; allowed: a whole number >= 1"], problems
    assert resolve.concrete({})["throwaway_chunk"] == 3, "`run` writes the default into the config"
    assert settings.read({"throwaway_chunk": 7}, "throwaway_chunk") == 7
    with pytest.raises(settings.SettingError, match="model_kwargs throwaway_chunk: 0 is out of range"):
        settings.read({"throwaway_chunk": 0}, "throwaway_chunk")
    assert READ.findall('settings.read(self.model_config.model_kwargs, "throwaway_chunk")') == ["throwaway_chunk"]
    assert not resume.is_free("config.process[0].model.model_kwargs.throwaway_chunk", 3, 4)
    monkeypatch.setitem(settings.CATALOGUE, new.name, dataclasses.replace(new, resume_may_change=True))
    assert resume.is_free("config.process[0].model.model_kwargs.throwaway_chunk", 3, 4)
    assert "| `throwaway_chunk` | a whole number >= 1 | `3` |" in options_doc.render()
    assert options_doc.main(["--check"]) == 1, "the options page must be regenerated"


def test_a_resume_changes_freely_only_what_the_catalogue_marks():
    where = "config.process[0].model.model_kwargs."
    for name, item in settings.model_kwargs_settings().items():
        assert resume.is_free(where + name, None, "x") is (item.resume_may_change is True), name
    assert resume.is_free("config.process[0].model.qtype", "int4_fused", "int4_w4a8"), "the same 4-bit codes"
    assert not resume.is_free("config.process[0].model.qtype", "uint4", "qfloat8")
    assert settings.CATALOGUE["qtype"].auto == settings.RUN
