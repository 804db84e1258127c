"""The settings catalogue (overlay/toolkit/settings.py): one table the launcher's schema, `run`'s
resolution, the trainer's readers and docs/options.md all come from."""

import ast
import re
from pathlib import Path

import pytest

from launcher import options_doc, trainer_rules
from launcher.runs.schema import MODEL_KWARGS, Vocabulary

ROOT = Path(__file__).resolve().parents[1]
settings = trainer_rules.settings()
GET = re.compile(r'model_kwargs\.get\(\s*(?:\n\+?\s*)?"(\w+)",\s*([^)\n]+)')


def test_docs_options_is_the_generated_page():
    assert options_doc.main(["--check"]) == 0, "run python -m launcher.options_doc"


def test_the_schema_checks_every_model_kwargs_setting_by_the_catalogues_rule():
    assert set(settings.model_kwargs_settings()) <= set(MODEL_KWARGS.keys)
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


def test_the_patches_defaults_are_the_catalogues():
    """A patch reads a setting with `model_kwargs.get(key, default)`; `run` writes every setting, so
    the default only matters for a config given to the trainer by hand: it must be the catalogue's."""
    found = {}
    for patch in sorted(ROOT.glob("patches/*/*.patch")):
        for key, default in GET.findall(patch.read_text(encoding="utf-8")):
            found.setdefault(key, set()).add(default.strip())
    assert {"streamed_loader", "stay_placed", "allow_unquantized_block_linears"} <= set(found), found
    for key, defaults in found.items():
        assert key in settings.CATALOGUE, f"{key}: a setting the patches read is missing from the catalogue"
        for default in defaults:
            expected = settings.CATALOGUE[key].default
            if default == "{}" or default.isupper():  # a shape or a named constant: the setting is unset
                assert expected is None, key
            else:
                assert ast.literal_eval(default) == expected, f"{key}: patch default {default}, catalogue {expected}"


def test_the_overlay_reads_settings_only_through_the_catalogue():
    offenders = [f"{path.name}: {key}" for path in ROOT.glob("overlay/toolkit/*.py")
                 for key in re.findall(r'kwargs\.get\("(\w+)"', path.read_text(encoding="utf-8"))
                 if key in settings.CATALOGUE]
    assert offenders == []
