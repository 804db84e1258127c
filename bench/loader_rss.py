"""Peak host RAM of loading a FLUX.2-shaped checkpoint: the fork's loader vs the streamed one.

Writes a synthetic single-file checkpoint with the fork's own Flux2 key names and
shapes (random bf16, written tensor by tensor so the writer stays small), then
loads it in a fresh subprocess per mode and reports the peak resident set size
(VmHWM, reset after imports, on Linux; ru_maxrss or the peak working set elsewhere)
above the child's resident size after its imports.

Modes:
  fork-load_file     safetensors.torch.load_file + load_state_dict(assign=True), as the fork,
                     then one read per 4 KiB page (the fork's next step reads them all)
  streamed-read      patch 0003's reader: read one block's tensors, release, next block
  fork-quantize      fork-load_file, then the fork's quantize_model on the CPU
  streamed-quantize  patch 0003's block-by-block build + quantize on the CPU

Run it with the trainer's interpreter, pointing at a patched trainer checkout:
  <venv>/bin/python -m bench.loader_rss --trainer <workdir>/trainer --sizes 3072:2:4,3072:4:8

Each size is "hidden:double_blocks:single_blocks" (FLUX.2 [dev] is 6144:8:48, 64 GB);
heads are hidden/128 so the rotary axes stay [32, 32, 32, 32]. Files are deleted
after each size unless --keep.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

MODES = ["fork-load_file", "streamed-read", "fork-quantize", "streamed-quantize"]
FLUX2_SRC = "extensions_built_in/diffusion_models/flux2/src/model.py"
GIB = 1024**3


def flux2_params(size: str) -> dict:
    hidden, depth, single = (int(v) for v in size.split(":"))
    if hidden % 128:
        raise SystemExit(f"hidden {hidden} must be a multiple of 128")
    return {
        "hidden_size": hidden,
        "num_heads": hidden // 128,
        "depth": depth,
        "depth_single_blocks": single,
        "axes_dim": [32, 32, 32, 32],
    }


def import_trainer(trainer: Path):
    """The fork's Flux2 classes and the patched loader/quantizer, imported from the checkout."""
    import importlib.util

    sys.path.insert(0, str(trainer))
    spec = importlib.util.spec_from_file_location("bench_flux2_src", trainer / FLUX2_SRC)
    src = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = src
    spec.loader.exec_module(src)
    import toolkit.streamed_safetensors as sst
    import toolkit.util.quantize as quantize

    return SimpleNamespace(src=src, sst=sst, quantize=quantize)


def meta_model(t, params: dict):
    import torch

    with torch.device("meta"):
        return t.src.Flux2(t.src.Flux2Params(**params))


# -- writer -------------------------------------------------------------------


def write_checkpoint(t, params: dict, path: Path, seed: int = 0) -> int:
    """A safetensors file of random bf16 with the model's keys; returns its size."""
    import torch

    shapes = {k: tuple(v.shape) for k, v in meta_model(t, params).state_dict().items()}
    header, offset = {}, 0
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * numel]}
        offset += 2 * numel
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    gen = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in shapes.items():
            numel = header[name]["data_offsets"][1] // 2 - header[name]["data_offsets"][0] // 2
            done = 0
            while done < numel:  # at most 16M values (32 MB) alive at once
                n = min(numel - done, 16 * 1024 * 1024)
                chunk = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
                f.write(chunk.view(torch.int16).numpy().tobytes())
                done += n
    return path.stat().st_size


# -- child: one load in a fresh process ----------------------------------------


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Restart the peak at the current RSS where the OS allows it (Linux); return the current RSS.

    Without a reset, a peak reached while importing would hide a smaller load.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmRSS")
    except OSError:
        return peak_rss()


def peak_rss() -> int:
    if os.path.exists("/proc/self/status"):
        return _proc_status("VmHWM")
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return psutil.Process().memory_info().peak_wset
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def stub_base_model(params_blocks):
    import torch

    return SimpleNamespace(
        device_torch=torch.device("cpu"),
        torch_dtype=torch.bfloat16,
        low_vram=False,
        model_config=SimpleNamespace(
            qtype="uint4", accuracy_recovery_adapter=None, low_vram=False, model_kwargs={}
        ),
        print_and_status_update=lambda message: None,
        get_transformer_block_names=lambda: params_blocks,
    )


def child(mode: str, trainer: Path, path: Path, params: dict) -> dict:
    import gc

    import torch
    from safetensors.torch import load_file

    t = import_trainer(trainer)
    blocks = ["double_blocks", "single_blocks"]
    base = stub_base_model(blocks)
    model = meta_model(t, params)
    gc.collect()
    baseline = reset_peak_rss()
    start = time.perf_counter()

    if mode.startswith("fork"):
        state = load_file(str(path), device="cpu")
        for key in state:
            state[key] = state[key].to(torch.bfloat16)
        model.load_state_dict(state, assign=True)
        del state
        if mode == "fork-load_file":
            # load_file maps the file lazily; the fork's next step (a copy to the
            # quantize device) reads every page, so touch one value per 4 KiB page
            for p in model.parameters():
                float(p.detach().reshape(-1)[::2048].float().sum())
        if mode == "fork-quantize":
            t.quantize.quantize_model(base, model)
    elif mode == "streamed-read":
        with t.sst.StreamedSafetensors(path) as st:
            for names in t.sst.group_keys(st.keys(), blocks).values():
                tensors = st.read_many(names)
                del tensors
    elif mode == "streamed-quantize":
        qtype = t.quantize.get_qtype("uint4")
        t.sst.load_blockwise(
            model,
            path,
            blocks,
            on_block=lambda prefix, block: t.quantize.quantize_transformer_block(
                base, block, qtype, name=prefix
            ),
            on_rest=lambda m: t.quantize.quantize_extras(base, m, qtype),
            dtype=torch.bfloat16,
            log=lambda message: None,
        )
    else:
        raise SystemExit(f"unknown mode {mode}")
    seconds = time.perf_counter() - start
    gc.collect()
    return {"baseline": baseline, "peak": peak_rss(), "seconds": seconds}


def run_child(mode: str, trainer: Path, path: Path, params: dict) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--trainer", str(trainer),
         "--path", str(path), "--params", json.dumps(params)],
        capture_output=True, text=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"error": f"rc {result.returncode}: {result.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


# -- driver -------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, required=True, help="patched trainer checkout")
    parser.add_argument("--sizes", default="3072:2:4,3072:4:8,6144:1:2",
                        help="comma-separated hidden:double_blocks:single_blocks (default %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    trainer = args.trainer.resolve()

    if args.child:
        print(json.dumps(child(args.child, trainer, args.path, json.loads(args.params))), flush=True)
        return 0

    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {sorted(unknown)}")
    workdir = Path(tempfile.mkdtemp(prefix="loader_rss_", dir=args.dir))
    t = import_trainer(trainer)
    rows = []
    try:
        for size in args.sizes.split(","):
            params = flux2_params(size)
            path = workdir / f"flux2-{size.replace(':', 'x')}.safetensors"
            began = time.perf_counter()
            file_size = write_checkpoint(t, params, path)
            print(f"{size}: wrote {file_size / GIB:.2f} GiB in {time.perf_counter() - began:.0f} s", flush=True)
            block = max(
                sum(v.numel() for v in blk.parameters()) * 2
                for blk in (meta_model(t, params).double_blocks[0], meta_model(t, params).single_blocks[0])
            ) if params["depth"] and params["depth_single_blocks"] else 0
            for mode in modes:
                result = run_child(mode, trainer, path, params)
                print(f"  {mode}: {result}", flush=True)
                rows.append((size, file_size, block, mode, result))
            if not args.keep:
                path.unlink()
    finally:
        if not args.keep:
            for leftover in workdir.glob("*.safetensors"):
                leftover.unlink()
            workdir.rmdir()

    print()
    print("| size (hidden:double:single) | file GiB | largest block GiB | mode | peak RSS above baseline GiB | peak RSS GiB | time s |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for size, file_size, block, mode, r in rows:
        if "error" in r:
            print(f"| {size} | {file_size / GIB:.2f} | {block / GIB:.2f} | {mode} | {r['error']} | | |")
            continue
        print(
            f"| {size} | {file_size / GIB:.2f} | {block / GIB:.2f} | {mode} | "
            f"{(r['peak'] - r['baseline']) / GIB:.2f} | {r['peak'] / GIB:.2f} | {r['seconds']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
