"""What the trainer accepts, read from the real checkout and asked from its venv."""

import json

import pytest
from tiny_run import tiny_preset

from launcher.cli import main
from launcher.envs.workdir import read_state, venv_python
from launcher.runs import vocabulary


@pytest.mark.trainer
def test_tables_read_from_the_fork_source(trainer_checkout):
    found = vocabulary.read_vocabulary(trainer_checkout)
    assert {"adamw", "adamw8bit", "lion8bit"} <= found.optimizers and "prodigy" in found.optimizer_prefixes
    assert {"lora", "lokr"} <= found.network_types
    assert {"bf16", "fp16", "float32"} <= found.dtypes
    assert "extension" in found.jobs
    assert {"streamed_loader", "quantize_device", "text_encoder_path", "flux2_params"} <= found.model_kwargs
    assert {"qtype", "quantize", "model_kwargs"} <= found.section_keys["model"]
    assert found.qtypes is None, "qtypes need the trainer's interpreter"


@pytest.mark.trainer
def test_qtypes_come_from_the_trainers_get_qtype_once_per_head(trainer_workdir, tmp_path, monkeypatch):
    python = venv_python(trainer_workdir.venv)
    cache = tmp_path / "qtypes.json"
    qtypes = vocabulary.trainer_qtypes(trainer_workdir.trainer, python, cache, "abc")
    assert {"uint4", "uint3", "float8", "int4_fused", "int4_w4a8", "qint4", "qint8"} <= qtypes
    assert "int3" not in qtypes and "QLinear" not in qtypes
    assert json.loads(cache.read_text()) == {"head": "abc", "qtypes": sorted(qtypes)}

    def no_trainer(*args, **kwargs):
        raise AssertionError("the trainer was asked again")

    monkeypatch.setattr(vocabulary, "run_module", no_trainer)
    assert vocabulary.trainer_qtypes(trainer_workdir.trainer, python, cache, "abc") == qtypes
    with pytest.raises(AssertionError, match="asked again"):
        vocabulary.trainer_qtypes(trainer_workdir.trainer, python, cache, "another head")


@pytest.mark.trainer
def test_an_unknown_qtype_is_refused_before_anything_loads(trainer_workdir, tmp_path, capsys):
    path = tiny_preset(tmp_path / "int3.yaml", model={"qtype": "int3"})
    assert read_state(trainer_workdir.state_file).get("head")
    assert main(["run", str(path), "--workdir", str(trainer_workdir.root), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "config.process[0].model.qtype = 'int3': not one of the allowed values" in err
    assert "int4_fused" in err and "did you mean `uint3`?" in err
    assert not (tmp_path / "out").exists()
