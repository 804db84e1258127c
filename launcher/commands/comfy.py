"""`comfy [RUN]`: a ComfyUI workflow for the run's LoRA, a check that ComfyUI loads it, and its placement.

Everything that can fail is checked before anything is written: the run and its saved LoRA,
the ComfyUI folder, the prompt, the LoRA's tensor names and shapes against the run's base
checkpoint, and the workflow against ComfyUI's template. A file of the same name and other
content in models/loras is replaced only with --force.
"""

import argparse
import hashlib
import json
from pathlib import Path

from launcher.comfy import folder, lora_check, templates, workflow
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir
from launcher.errors import LauncherError
from launcher.nofollow import is_link, refuse_links
from launcher.progress import say, warn
from launcher.runs.folders import RunFolder, find_run, read_run_process
from launcher.runs.prompts import caption_prompt
from launcher.user_files import UserFileError, load_json_state, read_text
from launcher.writer import replace_own

EXAMPLES = """examples:
  python -m launcher comfy --comfy-dir D:\\ComfyUI                  # the latest run's newest LoRA
  python -m launcher comfy my_run --checkpoint 500 --prompt "sks dog on a beach"
"""
OUTPUT_PREFIX = "flux2-24gb"
"""ComfyUI's output subfolder for the images these workflows save."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "comfy", help="write a ComfyUI workflow for a run's LoRA; check and place the LoRA",
        description=__doc__.splitlines()[0], epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", nargs="?", help="run folder or run name (default: the latest run)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: .aitk")
    parser.add_argument("--comfy-dir", type=Path, help="a ComfyUI folder: copy the LoRA to models/loras, check models")
    parser.add_argument("--checkpoint", default="latest", help="the step of the LoRA to use, or latest (default)")
    parser.add_argument("--prompt", help="the workflow's prompt (default: the first caption of the run's dataset)")
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument("--copy", dest="link", action="store_false", help="copy the LoRA (default)")
    placement.add_argument("--link", dest="link", action="store_true", help="link the LoRA instead of copying it")
    parser.add_argument("--force", action="store_true", help="replace a different file of the same name in models/loras, "
                        "or a workflow that comfy did not write")
    parser.set_defaults(handler=handle, link=False)


def handle(args) -> int:
    run = find_run(Workdir(args.workdir.resolve()).runs, args.run)
    config, process = read_run_process(run.root)
    lora = run.saved_lora(args.checkpoint)
    refuse_links(run.root, run.comfyui)  # before anything is written, here or in ComfyUI's models/loras
    if run.comfyui.exists() and not run.comfyui.is_dir():
        raise LauncherError(f"{run.comfyui} is a file where `comfy` writes its workflows; move it aside and run again")
    comfy_dir = folder.check_comfy_dir(args.comfy_dir.resolve()) if args.comfy_dir else None
    too_old = folder.version_note(comfy_dir) if comfy_dir else None
    if too_old:
        warn(too_old)
    prompt = args.prompt or caption_prompt(config)
    if not prompt:
        raise LauncherError(f"no caption found in the dataset named by {run.config}; pass --prompt \"...\"")
    arch = process["model"].get("arch")
    base = lora_check.base_checkpoint(process["model"]["name_or_path"], arch)
    summary = lora_check.check_lora(lora, base)
    say(f"LoRA check: {lora.name}: {summary.modules} Linear modules, {summary.tensors} tensors, rank "
        f"{'/'.join(map(str, summary.ranks))}; every tensor is one ComfyUI's FLUX.2 loader matches")
    template = templates.template_for(arch)  # the family's (klein: its base-model subgraph)
    built = workflow.build(workflow.load_template(template.name), lora.name, prompt, f"{OUTPUT_PREFIX}/{lora.stem}",
                           template.subgraph)
    if comfy_dir is not None:
        placed = folder.place_lora(lora, comfy_dir, link=args.link, force=args.force)
        say(f"LoRA in place: {placed}")
    write_workflows(run, lora, built, force=args.force)
    say(f"prompt: {prompt}")
    report_models(built.models, comfy_dir)
    note = templates.base_model_note(template, built.models, base, comfy_dir)
    if note:
        say(note)
    report_canvas_models(built.canvas_models, comfy_dir)
    return 0


WRITTEN = ".written.json"
"""In the run's comfyui/ folder: the SHA-256 of each workflow `comfy` wrote there, so that the next
`comfy` tells its own file (replaced) from one saved over it (kept, unless --force)."""


def write_workflows(run: RunFolder, lora: Path, built: workflow.Workflow, force: bool) -> None:
    """The two workflows beside the run; a file there that `comfy` did not write (a workflow the user
    edited and saved back) is replaced only with --force, as a LoRA in models/loras is."""
    refuse_links(run.root, run.comfyui)
    ui = run.comfyui / f"{lora.stem}.workflow.json"
    api = run.comfyui / f"{lora.stem}.api.json"
    texts = {ui: json.dumps(built.ui, indent=2, ensure_ascii=False) + "\n",
             api: json.dumps(built.api, indent=2, ensure_ascii=False) + "\n"}
    ledger = load_json_state(run.comfyui / WRITTEN)
    for path in texts:
        if not force and (path.exists() or is_link(path)) and _sha256(path, run.root) != ledger.get(path.name):
            raise LauncherError(f"{path} exists and `comfy` did not write it (a workflow saved over it?): pass "
                                "--force to replace it, or move it away")
    for path, text in texts.items():
        replace_own(path, text, run.root)  # replaces a link there, never its target
        ledger[path.name] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    replace_own(run.comfyui / WRITTEN, json.dumps(ledger, indent=1, sort_keys=True) + "\n", run.root)
    say(f"wrote {ui} (drag it onto the ComfyUI canvas)")
    say(f"wrote {api} (API format: POST {{\"prompt\": <its content>}} to ComfyUI's /prompt)")


def _sha256(path: Path, within: Path) -> str | None:
    try:
        return hashlib.sha256(read_text(path, "metadata", within).encode("utf-8")).hexdigest()
    except UserFileError:
        return None


def report_models(models: list[dict], comfy_dir: Path | None) -> None:
    """Which models the workflow loads, and with a ComfyUI folder, which of them it lacks."""
    if comfy_dir is None:
        say(f"the workflows need ComfyUI {'.'.join(map(str, folder.MIN_VERSION))} or newer (the first release "
            "that loads the FLUX.2 small-decoder VAE)")
        say("put the LoRA into ComfyUI's models/loras/ (or pass --comfy-dir); the workflow also loads:")
        for model in models:
            say(f"  {folder.model_location(model)}")
        return
    for model in models:
        found = folder.find_model(comfy_dir, model)
        if found:
            say(f"  found {found}")
        else:
            warn(f"{comfy_dir} lacks {folder.model_location(model)}, "
                 "unless a folder of its extra_model_paths.yaml has it")


def report_canvas_models(models: list[dict], comfy_dir: Path | None) -> None:
    """Files only the canvas workflow names: ComfyUI refuses to queue it without them, even with the
    switch that uses them off; the API workflow runs without them."""
    for model in models:
        found = folder.find_model(comfy_dir, model) if comfy_dir else None
        if found:
            say(f"  found {found} (for the canvas workflow)")
            continue
        where = f"{comfy_dir} lacks" if comfy_dir else "the canvas workflow also needs"
        (warn if comfy_dir else say)(
            f"{where} {folder.model_location(model)}: ComfyUI checks it before queueing the .workflow.json even "
            "with its switch off; download it, or queue the .api.json, which does not use it")
