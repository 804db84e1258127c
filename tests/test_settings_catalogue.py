"""The settings catalogue (flux2_contract/settings.py): one table the launcher's schema, `run`'s
resolution, the trainer's readers and docs/options.md all come from."""

import dataclasses
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import setting_reads
from conftest import IDENTITY, NO_GIT_UNDER_WINE

from flux2_contract import settings
from launcher import decision, options_doc, resolve
from launcher.runs import files, resume, schema_nodes
from launcher.runs.schema import MODEL_KWARGS, Vocabulary

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = set(settings.model_kwargs_settings())
READERS = setting_reads.readers((ROOT / "flux2_contract" / "settings.py").read_text(encoding="utf-8"))


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


def around(source: str) -> list[str]:
    """The reads of a catalogue setting around its readers in one module's source."""
    return [what for _, what in setting_reads.check(source, SETTINGS, READERS).around]


def test_the_overlay_and_the_contract_read_settings_only_through_the_catalogue():
    read = set()
    for path in sorted(ROOT.glob("overlay/toolkit/*.py")) + sorted(ROOT.glob("flux2_contract/*.py")):
        is_catalogue = path == ROOT / "flux2_contract" / "settings.py"
        found = setting_reads.check(path.read_text(encoding="utf-8"), SETTINGS, READERS, is_catalogue)
        assert found.around == [], path.name
        read |= set(found.through)
    assert {"w4a8_activations", "w4a8_gemm", "stream_mode", "launch_plan", "quantized_cache_dir"} <= read


@pytest.mark.parametrize("source", [
    "def load(self):\n    return self.model_config.model_kwargs.get('stream_mode', 'serialized')\n",
    "kw = self.model_config.model_kwargs\nmode = kw.get('stream_mode')\n",
    "kw = getattr(self.model_config, 'model_kwargs', None) or {}\nmode = kw['stream_mode']\n",
    "config = dict(process['model'].get('model_kwargs') or {})\nstreamed = 'stream_mode' in config\n",
    "from flux2_contract.settings import read as setting\nname = 'stream_mode'\nmode = setting(kw, name)\n",
    "import flux2_contract.settings as catalogue\nmode = catalogue.read(model_kwargs, 'stream_mod')\n",
], ids=["single quotes", "an alias", "getattr", "a copy and `in`", "a reader by another name", "a misspelt setting"])
def test_a_read_around_the_catalogue_is_found_whatever_its_spelling(source):
    assert len(around(source)) == 1, around(source)


def test_reads_through_the_catalogue_are_counted_under_any_import():
    source = ("from flux2_contract import settings as s\nfrom .settings import read, cache_folder\n"
              "a = s.read(cfg.model_kwargs, 'stream_mode')\nb = read(kw, \"memory_plan\")\n"
              "c = cache_folder(kw, 'quantized_cache_dir', None, 'q')\nd = kw.get('the_trainers_own_key', 1)\n")
    found = setting_reads.check(source, SETTINGS, READERS)
    assert found.around == [] and set(found.through) == {"stream_mode", "memory_plan", "quantized_cache_dir"}


@pytest.mark.skipif(NO_GIT_UNDER_WINE, reason="no git.exe under Wine")
def test_in_a_checkout_only_the_lines_added_after_the_base_are_judged(tmp_path):
    """Upstream's own code is not the project's to route; what the overlay and the series add is."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True,
                              env={**os.environ, **IDENTITY}).stdout.strip()
    module = tmp_path / "toolkit" / "model.py"
    module.parent.mkdir()
    (tmp_path / "flux2_contract").mkdir()
    (tmp_path / "flux2_contract" / "settings.py").write_bytes((ROOT / "flux2_contract" / "settings.py").read_bytes())
    module.write_text("def upstream(kw):\n    return kw.get('stream_mode')\n", encoding="utf-8")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "base")
    base = git("rev-parse", "HEAD")
    module.write_text(module.read_text(encoding="utf-8") + "\n\ndef patched(cfg):\n    kw = cfg.model_kwargs\n"
                      "    return kw['memory_plan'], kw.get('stream_mode')\n", encoding="utf-8")
    git("commit", "-q", "-am", "a patch")
    judged = setting_reads.checkout_reads(tmp_path, base, SETTINGS)
    assert [what for _, what in judged["toolkit/model.py"].around] == ["kw['memory_plan']", "kw.get('stream_mode')"]


@pytest.mark.trainer
def test_the_overlay_and_the_series_read_settings_only_through_the_catalogue(target_workdir):
    """Each target's checkout as `setup` built it: the lines its overlay and series add to the
    trainer read every setting with a catalogue reader, never a literal default of their own
    (`model_kwargs.get(key, default)`) that could drift from the catalogue's."""
    judged = setting_reads.checkout_reads(target_workdir.workdir.trainer, target_workdir.target.commit, SETTINGS)
    assert {path: found.around for path, found in judged.items() if found.around} == {}
    read = {key for found in judged.values() for key in found.through}
    assert {"streamed_loader", "stay_placed", "allow_unquantized_block_linears", "flux2_params", "all_extensions"} <= read


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
    block = schema_nodes.Block(schema_nodes.catalogued(settings.model_kwargs_settings(), {}))
    problems = list(block.check({"throwaway_chunk": 0}, "kw", Vocabulary()))
    assert problems == ["kw.throwaway_chunk = 0: out of range; allowed: a whole number >= 1"], problems
    assert resolve.concrete({})["throwaway_chunk"] == 3, "`run` writes the default into the config"
    assert settings.read({"throwaway_chunk": 7}, "throwaway_chunk") == 7
    with pytest.raises(settings.SettingError, match="model_kwargs throwaway_chunk: 0 is out of range"):
        settings.read({"throwaway_chunk": 0}, "throwaway_chunk")
    reader = 'from toolkit import settings\nsettings.read(self.model_config.model_kwargs, "throwaway_chunk")\n'
    assert setting_reads.check(reader, set(settings.model_kwargs_settings()), READERS).through.keys() == {"throwaway_chunk"}
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
