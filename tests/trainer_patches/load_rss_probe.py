#!/usr/bin/env python3
"""Peak host RSS of the trainer's transformer load vs depth: streamed + quantize, and from the cache.

Runs the patched trainer's own Flux2Model.load_model (stopped where the text encoder would
load: the transformer is complete there) in a fresh process per measurement, on a random
FLUX.2-shaped checkpoint, and reports:

  peak_gib   VmHWM above the RSS after imports (the kernel's high-water mark, reset after
             imports through /proc/self/clear_refs), i.e. what the load itself needed
  kept_gib   RSS above that baseline once the load returned
  moved_gib  RSS above the baseline once the transformer has left the host (moved to the meta
             device, as training moves it to the GPU): what stays for the whole training
  trimmed_gib  the same after gc + returning the C heap's free pages (malloc_trim)
  host_tensor_gib  bytes of the loaded transformer's tensors on the CPU, each storage counted
             once (quantized tensor subclasses through their inner tensors): exact, no
             allocator noise
  streamed_gib  bytes of the blocks a memory plan streams from host memory (0 without one)
  streamed_host_gib  bytes of the host chunks the streamer packs them into

Modes, each at every size given:
  first   no cache yet: streamed read + quantize per block (+ the cache written)
  cache   the cache written by `first` is loaded
and placements of the quantized blocks:
  cpu       the fork's parking: the whole quantized model in host RAM
  offhost   blocks placed on a device as they are built; on a CPU machine the meta device
            stands in for the GPU (it holds no host memory, as the GPU would not), so what
            remains is the host RAM the loader itself needs
  plan      offhost under a memory plan that streams every other block (a fixed plan, the
            blocks a small card would stream): those stay on the host, for qtype int4_fused

Linux only (VmHWM, clear_refs). `test_load_host_memory.py` runs it at two depths; it lives
with the tests so that what CI checks cannot change with the benchmarks. The benchmark of the
same name (`python -m bench.run load_rss_depth`) runs this file; by hand, with the trainer
venv's interpreter:

    <venv>/bin/python tests/trainer_patches/load_rss_probe.py --trainer <workdir>/trainer \
        --dir <scratch> --sizes 1024:2:8,1024:4:16 --qtypes uint4,int4_fused --out rss.jsonl
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30


def proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def host_tensor_bytes(model) -> int:
    """Bytes of the model's parameters and buffers that live on the CPU, each storage once;
    tensor subclasses (torchao's quantized weights) are counted through their inner tensors."""
    seen, total = set(), 0
    pending = [*model.parameters(), *model.buffers()]
    while pending:
        tensor = pending.pop()
        if hasattr(tensor, "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            pending += [getattr(tensor, name) for name in names]
            continue
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def flux2_params(size: str) -> dict:
    """hidden:double:single -> FLUX.2 params; heads of 128 keep the rotary axes [32, 32, 32, 32]."""
    hidden, depth, single = (int(v) for v in size.split(":"))
    return {"hidden_size": hidden, "num_heads": hidden // 128, "depth": depth, "depth_single_blocks": single,
            "axes_dim": [32, 32, 32, 32]}


def write_checkpoint(trainer: Path, params: dict, path: Path) -> None:
    """Random bf16 weights under the trainer's own FLUX.2 keys and shapes (N(0, 0.02), seed 0)."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(trainer))
    from extensions_built_in.diffusion_models.flux2.src.model import Flux2, Flux2Params

    with torch.device("meta"):
        shapes = {name: value.shape for name, value in Flux2(Flux2Params(**params)).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    save_file({name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
               for name, shape in shapes.items()}, str(path))


def model_config(checkpoint: Path, params: dict, qtype: str, cache_dir: Path, cache: bool, staging_mib):
    from toolkit.config_modules import ModelConfig

    kwargs = {"flux2_params": params, "quantize_device": "cpu", "quantized_cache": cache,
              "quantized_cache_dir": str(cache_dir)}
    if staging_mib:
        kwargs["cache_staging_mib"] = staging_mib
    return ModelConfig(name_or_path=str(checkpoint.parent), arch="flux2", quantize=True, qtype=qtype,
                       quantize_te=False, low_vram=False, layer_offloading=False, model_kwargs=kwargs)


class StopAtTextEncoder(Exception):
    pass


def stream_every_other_block(params: dict) -> None:
    """Every memory plan of this process keeps the even blocks of each list resident and streams
    the odd ones."""
    from toolkit import memory_budget
    from flux2_contract import memory_plan

    names = [f"double_blocks.{i}" for i in range(params["depth"])]
    names += [f"single_blocks.{i}" for i in range(params["depth_single_blocks"])]
    blocks = [memory_plan.BlockPlan(name, memory_plan.STREAMED if int(name.split(".")[1]) % 2 else memory_plan.RESIDENT,
                                    memory_plan.RECOMPUTED) for name in names]
    plan = memory_plan.MemoryPlan(budget_bytes=24 * GIB, blocks=blocks)
    memory_budget.plan_for = lambda *_, **__: plan


def child(args) -> dict:
    """One load in this process; returns the figures."""
    import gc

    sys.path.insert(0, str(args.trainer))
    os.chdir(args.trainer)
    import extensions_built_in.diffusion_models.flux2.flux2_model as flux2

    loaded = []

    class NoTextEncoder:
        @staticmethod
        def from_pretrained(*_, **__):
            frame = sys._getframe(1)  # load_model's local (the encoder may load in a method of its own)
            while "transformer" not in frame.f_locals:
                frame = frame.f_back
            loaded.append(frame.f_locals["transformer"])
            raise StopAtTextEncoder

    flux2.Mistral3ForConditionalGeneration = NoTextEncoder
    params = json.loads(args.params)
    # offhost: nothing of the meta device's is host memory, like a GPU's; no cache can be
    # written from it, so `first` runs without one there
    cache = not (args.place != "cpu" and args.mode == "first")
    config = model_config(args.checkpoint, params, args.qtype, args.cache_dir, cache, args.staging_mib)
    if args.place == "plan":
        config.model_kwargs.update(memory_plan="auto", vram_budget_gib=24)
        stream_every_other_block(params)
    base = flux2.Flux2Model(device="cpu" if args.place == "cpu" else "meta", model_config=config, dtype="bf16")
    base.training_folder = str(args.cache_dir)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS
    baseline = proc_status("VmRSS")
    start = time.perf_counter()
    try:
        base.load_model()
    except StopAtTextEncoder:
        pass
    seconds = time.perf_counter() - start
    gc.collect()
    figures = {
        "peak_gib": (proc_status("VmHWM") - baseline) / GIB,
        "kept_gib": (proc_status("VmRSS") - baseline) / GIB,
        "baseline_gib": baseline / GIB,
        "seconds": seconds,
    }
    figures["host_tensor_gib"] = host_tensor_bytes(loaded[-1]) / GIB
    from toolkit import block_streaming

    streamer = block_streaming._active
    figures["streamed_gib"] = (streamer.streamed_bytes() if streamer is not None else 0) / GIB
    figures["streamed_host_gib"] = sum(chunk.nbytes for chunk in streamer.chunks) / GIB if streamer is not None else 0
    loaded.pop().to("meta")
    gc.collect()
    figures["moved_gib"] = (proc_status("VmRSS") - baseline) / GIB
    ctypes.CDLL(None).malloc_trim(0)
    figures["trimmed_gib"] = (proc_status("VmRSS") - baseline) / GIB
    return figures


def measure(args, size: str, qtype: str, mode: str, place: str, checkpoint: Path, cache_dir: Path) -> dict:
    params = flux2_params(size)
    command = [sys.executable, __file__, "--child", "--trainer", str(args.trainer), "--checkpoint", str(checkpoint),
               "--params", json.dumps(params), "--qtype", qtype, "--mode", mode, "--place", place,
               "--cache-dir", str(cache_dir)] + (["--staging-mib", str(args.staging_mib)] if args.staging_mib else [])
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode:
        raise SystemExit(f"{size} {qtype} {mode} {place} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    return {"size": size, "qtype": qtype, "mode": mode, "place": place, **figures}


def parent(args) -> None:
    args.dir.mkdir(parents=True, exist_ok=True)
    out = open(args.out, "a", encoding="utf-8") if args.out else None
    for size in args.sizes.split(","):
        folder = args.dir / size.replace(":", "x")
        checkpoint = folder / "flux2-dev.safetensors"
        if not checkpoint.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            write_checkpoint(args.trainer, flux2_params(size), checkpoint)
        for qtype in args.qtypes.split(","):
            cache_dir = folder / f"cache-{qtype}"
            for place in args.places.split(","):
                for mode in ("first", "cache"):
                    if mode == "first" and place == "cpu":
                        for old in cache_dir.glob("*"):
                            old.unlink()
                    row = measure(args, size, qtype, mode, place, checkpoint, cache_dir)
                    row["file_gib"] = checkpoint.stat().st_size / GIB
                    print(json.dumps(row), flush=True)
                    if out:
                        out.write(json.dumps(row) + "\n")
                        out.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", required=True, type=Path)
    p.add_argument("--dir", type=Path, help="where checkpoints and caches go (required)")
    p.add_argument("--sizes", default="1024:2:8,1024:4:16", help="hidden:double:single, comma-separated")
    p.add_argument("--qtypes", default="uint4,int4_fused")
    p.add_argument("--places", default="cpu,offhost", help="cpu: parked on the host; offhost: placed on meta; "
                   "plan: placed on meta, every other block streamed from the host")
    p.add_argument("--out", type=Path, help="append JSON rows here")
    p.add_argument("--staging-mib", type=int, help="model_kwargs cache_staging_mib (default: the trainer's)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--params", help=argparse.SUPPRESS)
    p.add_argument("--qtype", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--place", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.trainer = args.trainer.resolve()
    if not args.child and args.dir is None:
        p.error("--dir is required: a scratch folder for the checkpoints and caches")
    if args.child:
        print(json.dumps(child(args)), flush=True)
    else:
        parent(args)


if __name__ == "__main__":
    main()
