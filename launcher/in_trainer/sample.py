"""`launcher sample`, trainer side: load a run's model and LoRA, write PNGs and a contact sheet.

Runs under the trainer venv's interpreter (torch and the patched trainer are there); the
launcher has already checked the input. The work itself is the trainer's `toolkit.lora_sampler`
(shared with in-training sampling); this module only reads the run's config and the arguments.
The last line printed is one JSON object: the files written and the seconds each part took.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, required=True, help="the patched trainer checkout")
    parser.add_argument("--config", type=Path, required=True, help="the run's rendered config.yaml")
    parser.add_argument("--lora", type=Path, help="the LoRA file (none: the base model only)")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--strength", type=float, action="append", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs and contact_sheet.png")
    parser.add_argument("--device", help="default: the GPU when torch sees one, else the CPU")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    trainer = args.trainer.resolve()
    sys.path.insert(0, str(trainer))
    os.chdir(trainer)  # the trainer resolves some of its own files relative to its root
    import yaml
    from toolkit import lora_sampler

    process = yaml.safe_load(args.config.read_text(encoding="utf-8"))["config"]["process"][0]
    dtype = process.get("train", {}).get("dtype", "bf16")
    start = time.perf_counter()
    model = lora_sampler.load_model(process["model"], dtype, args.prompt, process["training_folder"], args.device)
    loaded = time.perf_counter()
    hooks = None
    if args.lora is not None:
        hooks = lora_sampler.attach_lora(model.transformer, lora_sampler.load_lora(args.lora),
                                         model.device_torch, model.torch_dtype)
    request = lora_sampler.SampleRequest(args.prompt, args.strength, args.seed, args.size, args.steps, args.out)
    try:
        written = lora_sampler.sample_grid(model, hooks, request)
    except lora_sampler.NonFiniteSample as error:
        print(f"[sample] error: {error}", file=sys.stderr, flush=True)
        return 3
    done = time.perf_counter()
    print(json.dumps({"written": [str(p) for p in written], "load_s": round(loaded - start, 2),
                      "sample_s": round(done - loaded, 2), "images": len(written) - 1}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
