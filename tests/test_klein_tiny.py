"""The tiny FLUX.2 klein 4B (launcher/in_trainer/tiny_assets.py --builder klein_4b), built under the trainer
of the target that has klein: its Qwen3 encoder gives, through the trainer's own klein prompt
path, embeddings as wide as its transformer's context, and its transformer is klein's (no
guidance embedding)."""

import json
import subprocess

import pytest

from launcher.envs.trainer_python import child_env, module_command
from launcher.envs.workdir import venv_python
from launcher.in_trainer import tiny_assets

pytestmark = pytest.mark.trainer

EMBED = """
import sys, types
sys.path.insert(0, sys.argv[1])
from transformers import Qwen2Tokenizer, Qwen3ForCausalLM
from extensions_built_in.diffusion_models.flux2.src.pipeline import Flux2Pipeline
folder = sys.argv[2]
encoder = types.SimpleNamespace(tokenizer=Qwen2Tokenizer.from_pretrained(folder),
                                text_encoder=Qwen3ForCausalLM.from_pretrained(folder), _execution_device="cpu")
embeds, _ = Flux2Pipeline._get_qwen_prompt_embeds(encoder, ["a photo of a red square"], "cpu")
print(list(embeds.shape))
"""


@pytest.fixture(scope="module")
def klein_assets(installed_workdirs, tmp_path_factory):
    workdir = installed_workdirs("upstream-main")
    out = tmp_path_factory.mktemp("tiny-klein")
    python = venv_python(workdir.venv)
    done = subprocess.run(module_command(python, "tiny_assets", "--builder", "klein_4b", "--trainer", str(workdir.trainer),
                                         "--out", str(out)), env=child_env(python=python), timeout=600)
    assert done.returncode == 0
    return workdir, python, out


def test_the_tiny_klein_encoder_fills_the_transformer_s_context(klein_assets):
    workdir, python, out = klein_assets
    manifest = json.loads((out / tiny_assets.MANIFEST_NAME).read_text(encoding="utf-8"))
    assert manifest["arch"] == "flux2_klein_4b"
    encoder = out / manifest["model_kwargs"]["text_encoder_path"]
    done = subprocess.run([str(python), "-c", EMBED, str(workdir.trainer), str(encoder)], capture_output=True,
                          text=True, env=child_env(python=python), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [1, 512, manifest["model_kwargs"]["flux2_params"]["context_in_dim"]]


def test_the_tiny_klein_transformer_is_klein_s(klein_assets):
    from launcher.runs.validate import safetensors_header

    _, _, out = klein_assets
    names = set(safetensors_header(out / tiny_assets.KLEIN_TRANSFORMER_FILE))
    assert any(name.startswith("double_blocks.0.") for name in names)
    assert not any(name.startswith("guidance_in.") for name in names)
    assert not (out / tiny_assets.TRANSFORMER_FILE).exists()

