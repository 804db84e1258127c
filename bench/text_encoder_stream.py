"""The text phase's encoder (walls 3-4): streamed layer by layer vs the whole Mistral3, one machine.

Writes a random-weight Mistral3 folder (language model only, one shard per layer; the tokenizer
files are copied from `--tokenizer-from`, e.g. the tiny FLUX.2's text_encoder folder), then runs,
each in its own process so host peaks (VmHWM, Linux) are its own:
  * streamed: the trainer's toolkit/streamed_text_encoder.py (from `--trainer`), all prompts;
  * whole: Mistral3ForConditionalGeneration.from_pretrained, moved to the device, one forward
    with output_hidden_states, as the FLUX.2 pipeline calls it;
and compares the stacked hidden states. Defaults: full width (hidden 5120, MLP 32768, vocab
131072, 32 heads, 8 KV heads), 8 layers, states (2, 4, 6), 8 prompts of 512 tokens.

    python -m bench.text_encoder_stream --trainer W/trainer --tokenizer-from TINY/text_encoder --out r.json
    ... --device cpu --hidden 256 --intermediate 512 --vocab 1000 --heads 4 --kv-heads 2   (a CPU dry run)
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SYSTEM = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
          "object relationships, object\nattribution and actions without speculation.")
PROMPTS = ["a photo of a red square on a white background", "", "a green circle", "blue " * 200,
           "a photo of a yellow circle on a black background", "square", "a photo", "white background"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "processor_config.json", "preprocessor_config.json")


def messages(texts):
    return [[{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
             {"role": "user", "content": [{"type": "text", "text": t}]}] for t in texts]


def host_peak() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def vram_peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(a) -> None:
    from safetensors.torch import save_file
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (Path(a.tokenizer_from) / name).is_file():
            shutil.copy(Path(a.tokenizer_from) / name, work / name)
    head = a.hidden // a.heads
    text = MistralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                         head_dim=head, max_position_embeddings=4096, sliding_window=None, rope_theta=1e9,
                         rms_norm_eps=1e-5, pad_token_id=3)
    vision = PixtralVisionConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, head_dim=64,
                                 intermediate_size=128)
    Mistral3Config(text_config=text, vision_config=vision, image_token_index=8).to_json_file(work / "config.json")
    generator = torch.Generator(device=a.device).manual_seed(0)

    def random(*shape):
        if len(shape) == 1:  # norm weights near 1
            return (1 + 0.1 * torch.randn(*shape, generator=generator, device=a.device)).to(torch.bfloat16).cpu()
        return (torch.randn(*shape, generator=generator, device=a.device) * shape[1] ** -0.5).to(torch.bfloat16).cpu()

    prefix, weight_map = "language_model.model.", {}

    def shard(name, tensors):
        save_file(tensors, str(work / name))
        weight_map.update({key: name for key in tensors})

    shard("embed.safetensors", {prefix + "embed_tokens.weight": random(a.vocab, a.hidden),
                                prefix + "norm.weight": random(a.hidden)})
    q, kv, h, i = a.heads * head, a.kv_heads * head, a.hidden, a.intermediate
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i)}
    for index in range(a.layers):
        shard(f"layer-{index:03d}.safetensors",
              {f"{prefix}layers.{index}.{name}": random(*shape) for name, shape in shapes.items()})
    (work / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def streamed(a) -> dict:
    sys.path.insert(0, str(Path(a.trainer).resolve()))
    from toolkit.streamed_text_encoder import PromptTemplate, StreamedTextEncoder, open_encoder

    template = PromptTemplate(messages, 512, tuple(a.states))
    encoder = StreamedTextEncoder(open_encoder(a.work, max(a.states)), template, a.device, log=lambda m: None)
    encoder.tokenize(["warm up"])
    sync(a.device)
    before, start = host_peak(), time.perf_counter()
    out = encoder.encode(PROMPTS)
    sync(a.device)
    seconds = time.perf_counter() - start
    torch.save(out, Path(a.work) / "streamed.pt")
    return {"seconds": seconds, "host_peak_above_start_gib": (host_peak() - before) / 2**30,
            "vram_peak_gib": vram_peak_gib(a.device), "layers_run": max(a.states)}


def whole(a) -> dict:
    from transformers import AutoProcessor, Mistral3ForConditionalGeneration

    start = time.perf_counter()
    model = Mistral3ForConditionalGeneration.from_pretrained(a.work, dtype=torch.bfloat16)
    model.to(a.device, dtype=torch.bfloat16)
    inputs = AutoProcessor.from_pretrained(a.work).apply_chat_template(
        messages(PROMPTS), add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
        padding="max_length", truncation=True, max_length=512)
    with torch.no_grad():
        output = model(input_ids=inputs["input_ids"].to(a.device), attention_mask=inputs["attention_mask"].to(a.device),
                       output_hidden_states=True, use_cache=False)
    reference = torch.cat([output.hidden_states[k] for k in a.states], dim=-1).cpu()
    sync(a.device)
    torch.save(reference, Path(a.work) / "whole.pt")
    return {"seconds": time.perf_counter() - start, "host_peak_gib": host_peak() / 2**30,
            "vram_peak_gib": vram_peak_gib(a.device)}


def compare(work: Path) -> dict:
    a, b = torch.load(work / "streamed.pt").float(), torch.load(work / "whole.pt").float()
    return {"shape": list(a.shape), "max_abs_diff": (a - b).abs().max().item(), "ref_max_abs": b.abs().max().item(),
            "exact_fraction": (a == b).float().mean().item(),
            "allclose_bf16": bool(torch.allclose(a, b, rtol=1.6e-2, atol=1.6e-2))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", required=True, help="a patched trainer checkout (for toolkit/)")
    parser.add_argument("--tokenizer-from", required=True, help="a Mistral3 folder whose tokenizer files to copy")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "text-encoder-stream"),
                        help="where the random encoder is written")
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--states", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--intermediate", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--step", choices=["build", "streamed", "whole"], help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.step:
        print(json.dumps({a.step: {"build": build, "streamed": streamed, "whole": whole}[a.step](a)}))
        return 0
    result, start = {}, time.perf_counter()
    for step in ("build", "streamed", "whole"):
        child = subprocess.run([sys.executable, *sys.argv, "--step", step], capture_output=True, text=True)
        if child.returncode:
            print(child.stderr[-4000:], file=sys.stderr)
            return child.returncode
        result.update(json.loads(child.stdout.strip().splitlines()[-1]))
    result.pop("build", None)
    result.update(compare(Path(a.work)), total_seconds=time.perf_counter() - start)
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
