#!/usr/bin/env python3
"""Time to load the quantized cache vs the disk's sequential read rate (figure 2).

1. Build a FLUX.2 transformer with random weights block by block straight into the fork's uint4
   form (bench/_trainer.build_random: the trainer's quantize_transformer_block per block on
   --device, quantize_extras on the CPU) and save it with the trainer's own QuantizedCache.save
   (toolkit/quantized_cache.py), keyed to a small stand-in "source" file.
2. Cold load (page cache dropped with posix_fadvise DONTNEED): the trainer's
   QuantizedCache.load_into on a fresh meta-device model: header check, plain reads, sha256 of
   every tensor, rebuild of the torchao tensors, assignment.
3. Cold sequential read of the same file: plain 64 MiB readinto() calls into one buffer.
4. Warm load (file now in the page cache): the same load_into, to separate the CPU work
   (copy + sha256 + rebuild) from the disk.
5. sha256 rate of this CPU on 1 GiB in memory.

With --load-device cuda, every cold load fills the model on the GPU instead: once the way the
trainer did before (the whole model read into host RAM, then moved), and once per --staging
kind through toolkit/staged_load.py's bounded staging buffers (pinned or plain host memory),
each with the peak host RSS it added (VmHWM, reset before the load).

    python -m bench.cache_load --trainer DIR --workdir QC --out r.json                 # full size
    python -m bench.cache_load --trainer DIR --hidden 1536 --heads 12 --device cpu ... # reduced

The cache file stays in --workdir (bench/train_step.py --cache can then load it).
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--trainer", required=True, type=Path)
p.add_argument("--workdir", required=True, type=Path)
p.add_argument("--device", default="cuda", help="where each block is quantized")
p.add_argument("--hidden", type=int, default=None)
p.add_argument("--heads", type=int, default=None)
p.add_argument("--depth", type=int, default=None)
p.add_argument("--single", type=int, default=None)
p.add_argument("--tiny", action="store_true")
p.add_argument("--qtype", default="uint4", help="a torchao qtype of the trainer (cached kinds only)")
p.add_argument("--skip-warm", action="store_true")
p.add_argument("--load-device", default="cpu", help="where load_into puts the tensors: cpu or cuda")
p.add_argument("--staging", default="pinned,plain", help="staging kinds to time with --load-device cuda")
p.add_argument("--out", required=True, type=Path)
args = p.parse_args()

import torch  # noqa: E402

from bench import _trainer as T  # noqa: E402

R = {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": os.uname().nodename,
     "cpus": os.cpu_count(), "phase": "start"}


def save():
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(R, indent=1, default=str))


def log(*a):
    print(f"[cache {time.strftime('%H:%M:%S')}]", *a, flush=True)


tr = T.Trainer(args.trainer)
R["trainer_commit"] = tr.commit()
params = tr.params(tiny=args.tiny, hidden_size=args.hidden, num_heads=args.heads, depth=args.depth,
                   depth_single_blocks=args.single)
R["params"] = {k: getattr(params, k) for k in params.__dataclass_fields__}
args.workdir.mkdir(parents=True, exist_ok=True)
source = args.workdir / "random-flux2.source.json"  # stands in for flux2-dev.safetensors in the key
source.write_text(json.dumps({"random_weights": R["params"]}, sort_keys=True))
qt = tr.quantize  # imports toolkit/util/quantize.py (torchao, optimum-quanto)
R["stubs"] = tr.stubs


def make_cache(model):
    return tr.qcache.QuantizedCache(args.workdir, source, args.qtype, tr.qcache.model_signature(model),
                                    {"dtype": "bfloat16"})


# ---- 1. build + write
R["phase"] = "build"
save()
t0 = time.perf_counter()
model = T.build_random(tr, params, args.device, args.qtype, log=log)
R["build_s"] = time.perf_counter() - t0
R["n_params"] = sum(x.numel() for x in model.parameters())
cache = make_cache(model)
if cache.path.exists():
    cache.path.unlink()
t0 = time.perf_counter()
ok = cache.save(model)
R["write_s"] = time.perf_counter() - t0
if not ok:
    R["phase"] = "write:FAILED"
    save()
    sys.exit(1)
size = cache.path.stat().st_size
R["cache_path"] = str(cache.path)
R["cache_gib"] = size / T.GiB
R["write_gib_s"] = R["cache_gib"] / R["write_s"]
del model
import gc  # noqa: E402

gc.collect()
log(f"built in {R['build_s']:.1f}s; wrote {R['cache_gib']:.2f} GiB in {R['write_s']:.1f}s")
save()


def reset_peak_rss() -> int:
    """Restart VmHWM at the current RSS (Linux); the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return T.proc_status().get("VmRSS", 0)


def load_once(label, device="cpu", pin=True, then_move=None):
    """load_into on `device` (then, for the former path, the whole model moved to `then_move`)."""
    m = T.meta_model(tr, params)
    c = make_cache(m)
    c.staging = {**tr.qcache.staging_options({}), "pin": pin}
    before = reset_peak_rss()
    t0 = time.perf_counter()
    loaded = c.load_into(m, torch.device(device))
    if then_move:
        m.to(then_move)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    after = T.proc_status()
    if not loaded:
        raise SystemExit(f"{label}: load_into refused the cache")
    w = m.single_blocks[0].linear1.weight
    R[label] = {"s": dt, "gib_s": R["cache_gib"] / dt, "weight_type": type(w).__name__, "device": str(w.device),
                "rss_added_gib": (after.get("VmRSS", 0) - before) / T.GiB,
                "peak_rss_added_gib": (after.get("VmHWM", 0) - before) / T.GiB}
    log(f"{label}: {dt:.2f}s = {R['cache_gib'] / dt:.2f} GiB/s, peak host RSS +{R[label]['peak_rss_added_gib']:.2f} GiB")
    del m, c
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def raw_read(label):
    buf = bytearray(64 * 2**20)
    view = memoryview(buf)
    t0 = time.perf_counter()
    n = 0
    with open(cache.path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(view)
            if not k:
                break
            n += k
    dt = time.perf_counter() - t0
    R[label] = {"s": dt, "gib_s": n / T.GiB / dt, "bytes": n}
    log(f"{label}: {dt:.2f}s = {n / T.GiB / dt:.2f} GiB/s")


# ---- 2-4
R["phase"] = "measure"
R["page_cache_dropped"] = T.drop_file_cache(cache.path)
if args.load_device == "cpu":
    load_once("cold_load")
else:
    load_once("cold_load_host_then_move", "cpu", then_move=args.load_device)
    for kind in args.staging.split(","):
        T.drop_file_cache(cache.path)
        load_once(f"cold_load_{kind}", args.load_device, pin=kind == "pinned")
    R["cold_load"] = R[f"cold_load_{args.staging.split(',')[0]}"]
T.drop_file_cache(cache.path)
raw_read("cold_read")
if not args.skip_warm:
    raw_read("warm_read")
    load_once("warm_load", args.load_device)
# ---- 5
blob = os.urandom(2**28) * 4
t0 = time.perf_counter()
hashlib.sha256(blob).hexdigest()
R["sha256_gib_s"] = 1.0 / (time.perf_counter() - t0)
R["load_vs_read"] = R["cold_load"]["s"] / R["cold_read"]["s"]
R["phase"] = "done"
save()
log(f"RESULT cache {R['cache_gib']:.2f} GiB: cold load {R['cold_load']['s']:.2f}s vs cold sequential read "
    f"{R['cold_read']['s']:.2f}s ({R['load_vs_read']:.2f}x); sha256 {R['sha256_gib_s']:.2f} GiB/s")
