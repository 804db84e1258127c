"""FLUX.2 klein's Qwen3 encoder in the text phase: host memory of the streamed encoder against the
whole one, on any Qwen3 folder (the tiny klein's `W/assets/tiny_klein/qwen3`, or a real snapshot).

Each side runs in its own process under the trainer venv (Linux: VmHWM and VmRSS of
/proc/self/status), after its imports and tokenizer are loaded, so the figure is what encoding
the prompts adds:
  * streamed: toolkit/streamed_text_encoder.py with klein's own template (Flux2KleinModel);
  * whole: Qwen3ForCausalLM.from_pretrained in bf16 and the pipeline's _get_qwen_prompt_embeds,
    as klein's load_te and encode_prompt do with quantize_te off;
and says whether the stacked hidden states are equal.

    W/venv/bin/python -m bench.qwen3_text_phase --trainer W/trainer --encoder W/assets/tiny_klein/qwen3
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPTS = ["a photo of a red square on a white background", "", "a green circle", "blue " * 200]
ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20), "MALLOC_TRIM_THRESHOLD_": str(2**20)}
"""One malloc arena and a fixed mmap threshold: the peak follows what is alive (as the tests pin it)."""

PROBE = """
import json, sys, torch
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[1])
from extensions_built_in.diffusion_models.flux2.flux2_klein_model import Flux2Klein4BModel
from extensions_built_in.diffusion_models.flux2.src.pipeline import Flux2Pipeline
from toolkit.streamed_text_encoder import StreamedTextEncoder, open_encoder

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

side, folder, out = sys.argv[2], sys.argv[3], sys.argv[4]
prompts = json.loads(sys.argv[5])
template = Flux2Klein4BModel.prompt_template(None)
if side == "streamed":
    encoder = StreamedTextEncoder(open_encoder(folder, max(template.hidden_layers)), template, "cpu", log=lambda m: None)
    encoder.tokenize(["warm up"])
    before = status("VmRSS:")
    states = encoder.encode(prompts)
else:
    from types import SimpleNamespace
    from transformers import Qwen2Tokenizer, Qwen3ForCausalLM
    pipe = SimpleNamespace(tokenizer=Qwen2Tokenizer.from_pretrained(folder), _execution_device="cpu")
    before = status("VmRSS:")
    pipe.text_encoder = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        states = torch.cat([Flux2Pipeline._get_qwen_prompt_embeds(pipe, [p], "cpu")[0] for p in prompts])
save_file({"states": states.contiguous()}, out)
print(json.dumps({"peak_above_baseline_mib": (status("VmHWM:") - before) / 2**20, "baseline_mib": before / 2**20}))
"""


def measure(side: str, trainer: Path, encoder: Path, work: Path) -> dict:
    out = work / f"{side}.safetensors"
    done = subprocess.run([sys.executable, "-c", PROBE, str(trainer), side, str(encoder), str(out), json.dumps(PROMPTS)],
                          capture_output=True, text=True, env={**os.environ, **ALLOCATOR_ENV})
    if done.returncode != 0:
        raise SystemExit(f"the {side} probe failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "states": out}


def main(argv: list[str] | None = None) -> int:
    import torch
    from safetensors.torch import load_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, required=True, help="a patched upstream-main trainer checkout")
    parser.add_argument("--encoder", type=Path, required=True, help="a Qwen3 folder (config, tokenizer, weights)")
    parser.add_argument("--work", type=Path, default=Path("qwen3-text-phase"), help="scratch folder for the states")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    results = {side: measure(side, args.trainer, args.encoder, args.work) for side in ("streamed", "whole")}
    states = [load_file(results[side].pop("states"))["states"] for side in ("streamed", "whole")]
    equal = torch.equal(*states)
    weights = sum(path.stat().st_size for path in args.encoder.glob("*.safetensors"))
    print(json.dumps({"encoder_weights_mib": weights / 2**20, "prompts": len(PROMPTS), **results,
                      "states_equal": equal}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
