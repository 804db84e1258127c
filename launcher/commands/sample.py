"""`sample [RUN]`: images of a run's LoRA at several strengths, and one contact sheet, without ComfyUI.

Everything that can be wrong is refused before the model loads: the prompts, the strengths, the
size, a checkpoint that does not exist or does not fit the run's base model (shapes from the
safetensors headers), a run still training. Then the trainer venv loads the base model the way
training does (the quantized cache; the cached prompt embeddings, or the streamed text encoder
for new prompts) plus the LoRA, and writes `<run>/samples/<step>/`: one PNG per prompt and
strength (same seed) and `contact_sheet.png` (rows = prompts, columns = strengths).
"""

import argparse
import os
from pathlib import Path

from launcher.comfy import lora_check
from launcher.envs.trainer_python import run_module
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, venv_python
from launcher.errors import LauncherError
from launcher.nofollow import refuse_links
from launcher.progress import say
from launcher.runs import files, samples
from launcher.runs.folders import find_run, read_run_process

EXAMPLES = """examples:
  python -m launcher sample                                   # the latest run's newest LoRA, strengths 0 and 1
  python -m launcher sample my_run --checkpoint 500 --prompt "sks dog on a beach" --prompt "sks dog, oil painting"
  python -m launcher sample my_run --strength 0,0.5,1 --seed 7 --size 768 --steps 28
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "sample", help="sample images of a run's LoRA at several strengths, with a contact sheet",
        description=__doc__.splitlines()[0], epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", nargs="?", help="run folder or run name (default: the latest run)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--checkpoint", default="latest", help="the step of the LoRA to use, or latest (default)")
    parser.add_argument("--prompt", action="append",
                        help="a prompt (repeat for more; default: the preset's sample prompts, else the first caption)")
    parser.add_argument("--strength", default="0,1", help="LoRA strengths, comma-separated (default: 0,1)")
    parser.add_argument("--seed", type=int, default=42, help="the same seed for every image (default: 42)")
    parser.add_argument("--size", type=int, help="square image side in px, a multiple of 16 (default: the preset's "
                        "sample width, else 512)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps (default: 20)")
    parser.set_defaults(handler=handle)


def handle(args) -> int:
    workdir = Workdir(args.workdir.resolve())
    run = find_run(workdir.runs, args.run)
    config, process = read_run_process(run.root)
    prompts = samples.check_prompts(args.prompt if args.prompt else samples.default_prompts(config),
                                    "--prompt" if args.prompt else f"{run.config} (sample.prompts)")
    strengths = samples.parse_strengths(args.strength)
    size = samples.check_size(args.size if args.size is not None else (process.get("sample") or {}).get("width") or 512)
    if args.steps < 1:
        raise LauncherError(f"--steps {args.steps}: give at least 1 denoising step (20 is the FLUX.2 [dev] default)")
    lora = run.saved_lora(args.checkpoint)
    summary = lora_check.check_lora(lora, lora_check.base_checkpoint(process["model"]["name_or_path"],
                                                                      process["model"].get("arch")))
    samples.check_not_training(run)
    out = refuse_links(run.root, samples.sample_folder(run, lora))  # the PNGs go nowhere else
    python = venv_python(workdir.venv)
    if not python.is_file() or not workdir.trainer.is_dir():
        raise LauncherError(f"sampling runs in the trainer venv, and {workdir.root} has none; run `python -m launcher setup` first")
    say(f"sampling {lora.name} (rank {'/'.join(map(str, summary.ranks))}): {len(prompts)} prompt(s) x strengths "
        f"{', '.join(f'{s:g}' for s in strengths)}, seed {args.seed}, {size} px, {args.steps} steps")
    command = ["--trainer", str(workdir.trainer.resolve()), "--config", str(run.config.resolve()),
               "--lora", str(lora.resolve()), "--seed", str(args.seed), "--size", str(size),
               "--steps", str(args.steps), "--out", str(out.resolve())]
    for prompt in prompts:
        command += ["--prompt", prompt]
    for strength in strengths:
        command += ["--strength", repr(strength)]
    result = run_module(python, "sample", *command, env=sample_env(workdir))
    if result.returncode != 0:
        raise LauncherError(f"sampling {lora.name} failed (exit {result.returncode}); the error is above")
    say(f"wrote {out / 'contact_sheet.png'} (rows: prompts, columns: strengths) and {len(prompts) * len(strengths)} PNGs")
    return 0


def sample_env(workdir: Workdir) -> dict[str, str]:
    """The caches training used: wall 8's quantized transformer, the text phase's embeddings, Triton's kernels."""
    return {files.ENV_QUANT_CACHE_DIR: os.environ.get(files.ENV_QUANT_CACHE_DIR) or str(workdir.quantized_cache),
            files.ENV_TEXT_CACHE_DIR: os.environ.get(files.ENV_TEXT_CACHE_DIR) or str(workdir.text_cache),
            "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or str(workdir.triton_cache)}
