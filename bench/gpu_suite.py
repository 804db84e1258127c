#!/usr/bin/env python3
"""Every GPU figure of bench/RESULTS.md in one command (figures 2 full size, 3, 4).

Runs, each in its own subprocess so that an OOM or a crash in one leaves the others:

  matmul      bf16 8192x8192x8192 torch.matmul: the ceiling MFU is measured against
  cache       bench/cache_load.py at full size: random uint4 transformer written with the
              trainer's QuantizedCache, cold/warm load vs cold sequential read (figure 2)
  uint4_*     bench/train_step.py --weights uint4 --cache <that file>, capped with
              set_per_process_memory_fraction, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True:
              512, 768, 1024 px batch 1 and 448 px batch 2 at 24 GiB, 512 px at 22 GiB (figure 3),
              then the four shapes uncapped (what a 24 GiB card would need)
  bf16        bench/train_step.py --weights bf16, uncapped, all four shapes (figure 4)

--set qtype runs instead, for --qtype (e.g. int4_fused), built straight from random blocks (no
cache child): the four shapes at 24 GiB and 512 px uncapped; --bf16-ref names an earlier
suite.json whose bf16 child the x bf16 column divides by.

Each child gets a time budget; the whole suite stops starting children at --budget seconds.
Writes suite.json (every child's JSON merged, rewritten after each child) and suite.log (all
output) into --out-dir, and prints a table last.

    python -m bench.gpu_suite --trainer .bench-carry/trainer --out-dir OUT            # GPU machine
    python -m bench.gpu_suite --trainer <checkout> --out-dir OUT --tiny --device cpu # dry run
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--trainer", required=True, type=Path)
p.add_argument("--out-dir", required=True, type=Path)
p.add_argument("--workdir", type=Path, default=Path(".bench-work"), help="cache file and child JSON")
p.add_argument("--budget", type=float, default=510.0, help="seconds; no child starts after this")
p.add_argument("--only", default="", help="comma list of child names to run (default all)")
p.add_argument("--tiny", action="store_true")
p.add_argument("--qtype", default="uint4", help="trainer qtype of the 4-bit variants (default: the fork's uint4)")
p.add_argument("--device", default="cuda")
p.add_argument("--set", default="figures", choices=["figures", "qtype"],
               help="figures: the children above; qtype: the --qtype children (see above)")
p.add_argument("--bf16-ref", type=Path, help="earlier suite.json with a bf16_uncapped child (x bf16 column)")
p.add_argument("--matmul-child", action="store_true", help=argparse.SUPPRESS)
p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
args = p.parse_args()
# the children run from the repository root (python -m bench.NAME): paths given relative to here
args.trainer, args.workdir, args.out_dir = (path.resolve() for path in (args.trainer, args.workdir, args.out_dir))


def matmul_child():
    import torch

    n = 8192 if args.device == "cuda" else 512
    dev = torch.device(args.device)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    ts = []
    for _ in range(20):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t0)
    ts.sort()
    flop = 2 * n**3
    r = {"n": n, "times_s": ts, "tflops_median": flop / ts[len(ts) // 2] / 1e12,
         "tflops_mean": flop / (sum(ts) / len(ts)) / 1e12, "tflops_best": flop / ts[0] / 1e12,
         "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    args.json.write_text(json.dumps(r, indent=1))
    print(f"matmul {n}^3 bf16: median {r['tflops_median']:.1f} TFLOP/s (mean {r['tflops_mean']:.1f}, "
          f"best {r['tflops_best']:.1f})", flush=True)


if args.matmul_child:
    matmul_child()
    sys.exit(0)

T0 = time.time()
args.out_dir.mkdir(parents=True, exist_ok=True)
args.workdir.mkdir(parents=True, exist_ok=True)
LOG = open(args.out_dir / "suite.log", "a", buffering=1)
SUITE = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:], "children": {}}


def say(msg):
    line = f"[suite +{time.time() - T0:5.0f}s] {msg}"
    print(line, flush=True)
    LOG.write(line + "\n")


def save():
    (args.out_dir / "suite.json").write_text(json.dumps(SUITE, indent=1, default=str))


def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


SUITE["machine"] = {
    "nvidia_smi": sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,"
                      "power.draw,power.limit,temperature.gpu", "--format=csv"]) if shutil.which("nvidia-smi") else None,
    "cpus": os.cpu_count(), "meminfo": sh(["head", "-3", "/proc/meminfo"]),
    "df_workdir": sh(["df", "-hT", str(args.workdir)]), "df_tmp": sh(["df", "-hT", "/tmp"]),
    "python": sys.version.split()[0],
}
say(f"machine: {json.dumps(SUITE['machine'])}")
save()


def run_child(name, cmd, timeout, env_extra=None):
    """Run one child, tee its output, merge its JSON; returns the child's JSON (or {})."""
    if args.only and name not in args.only.split(","):
        return {}
    left = args.budget - (time.time() - T0)
    if left < 20:
        SUITE["children"][name] = {"skipped": f"suite budget spent ({left:.0f}s left)"}
        say(f"{name}: skipped, budget spent")
        save()
        return {}
    timeout = min(timeout, left)
    js = args.workdir / f"{name}.json"
    if js.exists():
        js.unlink()
    cmd = [c.replace("{JSON}", str(js)).replace("{DEADLINE}", f"{time.time() + timeout - 8:.0f}") for c in cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env.update(env_extra or {})
    say(f"{name}: start (timeout {timeout:.0f}s): {' '.join(cmd)}  env+{env_extra or {}}")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE.parent)

    def pump():
        for line in proc.stdout:
            if "Warning" in line or "warnings.warn" in line:
                continue
            LOG.write(f"  {name}| {line}")
            print(f"  {name}| {line}", end="", flush=True)

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed (timeout)"
        proc.wait()
    th.join(timeout=5)
    res = {}
    if js.is_file():
        try:
            res = json.loads(js.read_text())
        except ValueError:
            res = {"json": "unreadable"}
    res["rc"] = rc
    res["wall_s"] = time.time() - t0
    res["env_extra"] = env_extra
    SUITE["children"][name] = res
    save()
    say(f"{name}: rc={rc} in {res['wall_s']:.0f}s")
    return res


py = sys.executable
tiny = ["--tiny", "--device", "cpu"] if args.tiny else ["--device", args.device]
tr = ["--trainer", str(args.trainer)]
EXP = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

mm = run_child("matmul", [py, "-u", "-m", "bench.gpu_suite", "--matmul-child", "--json", "{JSON}",
                          "--device", "cpu" if args.tiny else args.device] + tr + ["--out-dir", str(args.out_dir)],
               40)
if args.set == "qtype":  # no cache child: every child builds its weights from random blocks
    args.only = args.only or ",".join(["matmul"] + [f"{args.qtype}_{n}" for n in
                                                     ("512_cap24", "1024_cap24", "768_cap24", "448x2_cap24",
                                                      "512_uncapped")])
cache = run_child("cache", [py, "-u", "-m", "bench.cache_load"] + tr + tiny +
                  ["--workdir", str(args.workdir / "qcache"), "--qtype", args.qtype, "--out", "{JSON}"], 170)
cache_file = cache.get("cache_path") if cache.get("phase") == "done" else None
cache_arg = ["--cache", cache_file] if cache_file else []
if not cache_file:
    say("no cache file: the uint4 children build their weights directly")

step = [py, "-u", "-m", "bench.train_step"] + tr + tiny + ["--out", "{JSON}", "--deadline", "{DEADLINE}"]
r = "64" if args.tiny else None  # tiny: small latents
VARIANTS = [
    # name, shapes, weights, cap, timeout
    ("uint4_512_cap24", "512", "uint4", 24, 80),
    ("bf16_uncapped", "512,768,1024,448x2", "bf16", 0, 100),
    ("uint4_768_cap24", "768", "uint4", 24, 80),
    ("uint4_1024_cap24", "1024", "uint4", 24, 100),
    ("uint4_448x2_cap24", "448x2", "uint4", 24, 75),
    ("uint4_512_cap22", "512", "uint4", 22, 55),
    # what the 24 GiB runs would need: same weights, no cap (skipped when the budget is spent)
    ("uint4_uncapped", "512,768,1024,448x2", "uint4", 0, 120),
]
if args.set == "qtype":
    q = args.qtype
    VARIANTS = [  # most wanted first; the last ones are skipped when the budget runs out
        (f"{q}_512_cap24", "512", "uint4", 24, 75),
        (f"{q}_1024_cap24", "1024", "uint4", 24, 95),
        (f"{q}_768_cap24", "768", "uint4", 24, 85),
        (f"{q}_448x2_cap24", "448x2", "uint4", 24, 85),
        (f"{q}_512_uncapped", "512", "uint4", 0, 70),
    ]
for name, shapes, weights, cap, timeout in VARIANTS:
    if args.tiny:
        shapes = ",".join(s.replace("1024", "96").replace("768", "80").replace("512", "64").replace("448", "48")
                          for s in shapes.split(","))
    cmd = step + ["--tag", name, "--weights", args.qtype if weights == "uint4" else weights, "--shapes", shapes]
    if cap:
        cmd += ["--cap-gib", str(cap)]
    if weights == "uint4":
        cmd += cache_arg
    run_child(name, cmd, timeout, EXP)

# ---- summary
ceiling = mm.get("tflops_median")
SUITE["ceiling_tflops"] = ceiling
rows = []
bf16 = SUITE["children"].get("bf16_uncapped", {}).get("shapes", {})
if not bf16 and args.bf16_ref:
    bf16 = json.loads(args.bf16_ref.read_text())["children"]["bf16_uncapped"]["shapes"]
    SUITE["bf16_ref"] = str(args.bf16_ref)
for name, _, weights, cap, *_ in VARIANTS:
    ch = SUITE["children"].get(name, {})
    for spec, S in (ch.get("shapes") or {}).items():
        ref = bf16.get(spec, {}).get("s_per_step")
        row = {"variant": name, "shape": spec, "cap_gib": cap or None, "ok": S.get("ok"),
               "s_per_step": S.get("s_per_step"), "n": len(S.get("steps", [])),
               "fwd_s": S.get("fwd_s"), "bwd_opt_s": S.get("bwd_opt_s"),
               "peak_alloc_gib": S.get("peak_alloc_gib"), "peak_reserved_gib": S.get("peak_reserved_gib"),
               "tflops": S.get("achieved_tflops"),
               "mfu_pct": 100 * S["achieved_tflops"] / ceiling if ceiling and S.get("achieved_tflops") else None,
               "vs_bf16": S["s_per_step"] / ref if ref and S.get("s_per_step") and weights != "bf16" else None,
               "error": (S.get("error") or "")[:160]}
        rows.append(row)
SUITE["table"] = rows
SUITE["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
SUITE["suite_wall_s"] = time.time() - T0
save()


def f(v, fmt):
    if isinstance(v, (int, float)):
        return format(v, fmt)
    width = fmt.split(".")[0]
    return "-".rjust(int(width)) if width.isdigit() else "-"


CACHE_FIGURES = ("cache_gib", "build_s", "write_s", "cold_load", "cold_read", "warm_read", "warm_load", "sha256_gib_s")
say(f"ceiling {f(ceiling, '.1f')} TFLOP/s; cache: {json.dumps({k: cache.get(k) for k in CACHE_FIGURES}, default=str)}")
hdr = (f"{'variant':20s} {'shape':9s} {'s/step':>7s} {'n':>2s} {'fwd':>6s} {'bwd':>6s} {'alloc':>6s} {'resv':>6s} "
       f"{'TF/s':>6s} {'MFU%':>5s} {'xbf16':>5s}  error")
say(hdr)
for r_ in rows:
    say(f"{r_['variant']:20s} {r_['shape']:9s} {f(r_['s_per_step'], '7.3f')} {r_['n']:2d} {f(r_['fwd_s'], '6.3f')} "
        f"{f(r_['bwd_opt_s'], '6.3f')} {f(r_['peak_alloc_gib'], '6.2f')} {f(r_['peak_reserved_gib'], '6.2f')} "
        f"{f(r_['tflops'], '6.1f')} {f(r_['mfu_pct'], '5.1f')} {f(r_['vs_bf16'], '5.2f')}  {r_['error']}")
