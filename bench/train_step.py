#!/usr/bin/env python3
"""One LoRA training step of the patched trainer's FLUX.2, timed, with its peak VRAM (figures 3, 4).

One weight variant per process, one or more shapes in sequence:

  --weights uint4   the fork's qtype uint4 (torchao UIntXWeightOnlyConfig(torch.uint4)),
                    read from a quantized cache (--cache, written by bench/cache_load.py with the
                    trainer's toolkit/quantized_cache.py) or, without one, built block by block
                    with random weights through the trainer's quantize_transformer_block;
                    then moved to the GPU whole, as the trainer does.
  --weights int4_fused  the series' qtype int4_fused: every block Linear becomes the trainer's
                    Int4Linear (toolkit/int4_linear.py), the rest torchao uint4; built or read from
                    a cache as uint4.
  --weights bf16    bf16 weights, random, materialized block by block on the device.

Then: LoRA (rank 32, alpha 32) on every block Linear, the model's own gradient checkpointing
(Flux2.gradient_checkpointing, the trainer's checkpoint call as is), AdamW on the LoRA
parameters, MSE against a random target, inputs made by the trainer's batched_prc_img/txt.
Per shape: warm-up steps, then timed steps until --steps or the --deadline; the median.
Peak allocated/reserved VRAM are over the steps of that shape (reset before it).

    python -m bench.train_step --trainer DIR --weights uint4 --cache F --shapes 512 --cap-gib 24 --out r.json
    python -m bench.train_step --trainer DIR --weights bf16 --tiny --device cpu --shapes 64,64x2 --out t.json
    python -m bench.train_step --trainer DIR --weights int4_w4a8 --kernel w4a8_activations=fp8 \
        --kernel w4a8_gemm=scaled_mm --kernel int4_chunk_mib=256 --shapes 512 --out w.json

The 4-bit kernel is the run's model_kwargs, as in the trainer: each `--kernel KEY=VALUE` is one of
`w4a8_activations`, `w4a8_gemm`, `int4_chunk_mib`, `int4_kernel` (flux2_contract/settings.py; a
bad value is refused before anything loads), passed to the trainer's set_int4_activations; those
not given take the qtype's defaults (flux2_contract/qtypes.py). The JSON records them (`model_kwargs`)
and the kernel the block Linears took (`int4_linear.kernel`).

The JSON is rewritten after every phase, so a kill or an OOM leaves what was measured.
Exit code 0 when every shape ran, 2 when one hit OOM, 1 on any other failure.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from bench._settings import add_kernel_flag

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--trainer", required=True, type=Path, help="trainer checkout or .bench-carry/trainer")
p.add_argument("--weights", required=True,
               help="bf16, or a trainer qtype (uint4 = the fork's; any name toolkit/util/quantize.get_qtype knows)")
p.add_argument("--cache", type=Path, help="quantized cache to load (uint4); built directly if absent")
p.add_argument("--shapes", default="512", help="comma list of RES or RESxBATCH, e.g. 512,768,1024,448x2")
p.add_argument("--n-txt", type=int, default=512, help="text tokens (default 512)")
p.add_argument("--cap-gib", type=float, default=0.0, help="set_per_process_memory_fraction cap in GiB")
p.add_argument("--rank", type=int, default=32)
p.add_argument("--alpha", type=float, default=32.0)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--deadline", type=float, default=0.0, help="unix time by which to be done")
p.add_argument("--device", default="cuda")
p.add_argument("--tiny", action="store_true", help="tiny Flux2Params (CPU dry run)")
add_kernel_flag(p)
p.add_argument("--tag", default=None)
p.add_argument("--out", required=True, type=Path)
args = p.parse_args()
KERNEL = dict(args.kernel)  # the run's model_kwargs that choose the 4-bit kernel

R = {"tag": args.tag or args.weights, "argv": sys.argv[1:], "phase": "start", "shapes": {},
     "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "errors": [], "model_kwargs": KERNEL,
     "env": {k: os.environ[k] for k in ("TRITON_CACHE_AUTOTUNING",) if k in os.environ}}


def save():
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(R, indent=1, default=str))
    os.replace(tmp, args.out)


def log(*a):
    print(f"[{R['tag']} {time.strftime('%H:%M:%S')}]", *a, flush=True)


def fail(e, rc=1):
    R["errors"].append({"phase": R["phase"], "type": type(e).__name__, "msg": str(e)[:3000],
                        "tb": traceback.format_exc()[-4000:]})
    R["phase"] += ":FAILED"
    save()
    log(f"FAILED in {R['phase']}: {type(e).__name__}: {str(e)[:500]}")
    sys.exit(rc)


save()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import _trainer as T  # noqa: E402

DEV = torch.device(args.device)
CUDA = DEV.type == "cuda"
bf16 = torch.bfloat16
R["torch"] = torch.__version__


def sync():
    if CUDA:
        torch.cuda.synchronize()


def vram():
    if not CUDA:
        return {}
    return {"alloc_gib": torch.cuda.memory_allocated() / T.GiB,
            "reserved_gib": torch.cuda.memory_reserved() / T.GiB,
            "peak_alloc_gib": torch.cuda.max_memory_allocated() / T.GiB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / T.GiB}


try:
    R["phase"] = "setup"
    if CUDA:
        R["gpu"] = torch.cuda.get_device_name(0)
        total = torch.cuda.get_device_properties(0).total_memory
        R["gpu_total_gib"] = total / T.GiB
        if args.cap_gib > 0:
            torch.cuda.set_per_process_memory_fraction(args.cap_gib * T.GiB / total, 0)
            R["cap_gib"] = args.cap_gib
    tr = T.Trainer(args.trainer)
    R["trainer_commit"] = tr.commit()
    params = tr.params(tiny=args.tiny)
    R["params"] = {k: getattr(params, k) for k in params.__dataclass_fields__}
    QT = None if args.weights == "bf16" else args.weights
    if QT:
        q = tr.quantize
        import torchao
        R["torchao"] = torchao.__version__
        R["qtype_config"] = repr(getattr(q.get_qtype(QT), "config", q.get_qtype(QT)))
    R["stubs"] = tr.stubs
    save()

    R["phase"] = "build"
    t0 = time.perf_counter()
    if QT and args.cache and args.cache.is_file():
        model = T.meta_model(tr, params)
        meta, tensors = tr.qcache.read_cache(args.cache)
        t1 = time.perf_counter()
        state = tr.qcache.rebuild_state(meta, tensors, model)
        # since the int4_fused patch rebuild_state returns (state, swaps): the Int4Linear modules
        tr.qcache.assign_state(model, *(state if isinstance(state, tuple) else (state,)))
        del meta, tensors, state
        model.requires_grad_(False)
        R["weights_from"] = f"quantized cache {args.cache} ({args.cache.stat().st_size / T.GiB:.2f} GiB)"
        R["cache_read_s"] = t1 - t0
        R["cache_load_s"] = time.perf_counter() - t0
        R["host_after_cache"] = T.proc_status()
    else:
        model = T.build_random(tr, params, DEV, QT, log=log, model_kwargs=KERNEL)
        R["weights_from"] = "random, built block by block" + (
            " (trainer quantize_transformer_block on the device, parked on the CPU)"
            if QT else " on the device")
    if QT and hasattr(tr.quantize, "set_int4_activations"):  # the Int4Linears' kernel, from model_kwargs
        R["int4_8bit_linears"] = tr.quantize.set_int4_activations(model, tr.quantize.get_qtype(QT), KERNEL)
    t1 = time.perf_counter()
    model.to(DEV)  # the trainer moves the whole (quantized) transformer to the GPU
    sync()
    R["to_device_s"] = time.perf_counter() - t1
    R["build_s"] = time.perf_counter() - t0
    R["n_params"] = sum(x.numel() for x in model.parameters())
    if QT:
        lin = model.single_blocks[0].linear1
        if hasattr(lin, "qweight"):  # Int4Linear: .weight would dequantize the whole matrix
            R["block_weight_type"] = f"{type(lin).__name__} (qweight {lin.qweight.dtype} {tuple(lin.qweight.shape)})"
            i4 = sys.modules.get("toolkit.int4_linear")
            R["int4_linear"] = {
                "modules": sum(1 for m in model.modules() if type(m).__name__ == "Int4Linear"),
                "kernel": str(getattr(lin, "kernel", None)), "triton": getattr(i4, "HAVE_TRITON", None),
                "kernel_on_device": bool(i4 and i4.kernel_available(torch.empty(1, device=DEV, dtype=bf16)))}
        else:
            w = lin.weight
            R["block_weight_type"] = f"{type(w).__name__}/{type(getattr(w, 'tensor_impl', w)).__name__}"
    if CUDA:
        torch.cuda.empty_cache()
    R["vram_weights"] = vram()
    log(f"weights ready in {R['build_s']:.1f}s ({R['weights_from']}); {vram()}")
    save()

    R["phase"] = "lora"
    lora_params, n_lora = T.add_lora(model, args.rank, args.alpha, DEV)
    R["lora_modules"] = n_lora
    R["lora_params"] = sum(x.numel() for x in lora_params)
    opt = torch.optim.AdamW(lora_params, lr=1e-4)
    model.gradient_checkpointing = True  # Flux2.enable_gradient_checkpointing()
    model.train()
    save()
except SystemExit:
    raise
except Exception as e:
    fail(e)


def run_shape(spec: str):
    res, _, b = spec.partition("x")
    res, batch = int(res), int(b or 1)
    S = {"res": res, "batch": batch}
    R["shapes"][spec] = S
    inputs, target = T.make_inputs(tr, params, res, batch, args.n_txt if not args.tiny else 16, DEV)
    S["n_img"], S["n_txt"] = inputs["x"].shape[1], inputs["ctx"].shape[1]
    S["flops"] = T.step_flops(model, params, S["n_img"], S["n_txt"], batch, args.rank)

    def step():
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        out = model(**inputs)
        loss = F.mse_loss(out.float(), target.float())
        sync()
        t1 = time.perf_counter()
        loss.backward()
        opt.step()
        sync()
        t2 = time.perf_counter()
        return {"total_s": t2 - t0, "fwd_s": t1 - t0, "bwd_opt_s": t2 - t1, "loss": float(loss)}

    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    S["warmup"], S["steps"] = [], []
    for _ in range(args.warmup):
        S["warmup"].append(step())
        log(f"{spec} warm-up {S['warmup'][-1]['total_s']:.3f}s {vram()}")
        save()
    n = args.steps
    if args.deadline:
        last = S["warmup"][-1]["total_s"] if S["warmup"] else 1.0
        n = max(1, min(n, int((args.deadline - time.time() - 2) // last)))
    for _ in range(n):
        S["steps"].append(step())
        save()
    S["s_per_step"] = statistics.median(s["total_s"] for s in S["steps"])
    S["fwd_s"] = statistics.median(s["fwd_s"] for s in S["steps"])
    S["bwd_opt_s"] = statistics.median(s["bwd_opt_s"] for s in S["steps"])
    S["vram"] = vram()
    S["peak_alloc_gib"] = S["vram"].get("peak_alloc_gib")
    S["peak_reserved_gib"] = S["vram"].get("peak_reserved_gib")
    S["achieved_tflops"] = S["flops"]["total"] / S["s_per_step"] / 1e12
    grads = [x.grad for x in lora_params]
    S["lora_grads_nonzero"] = sum(1 for g in grads if g is not None and bool(g.abs().sum() > 0))
    S["ok"] = True
    log(f"RESULT {R['tag']} {spec}: {S['s_per_step']:.3f} s/step (median of {len(S['steps'])}), "
        f"peak alloc {S['peak_alloc_gib']} reserved {S['peak_reserved_gib']} GiB, "
        f"{S['achieved_tflops']:.1f} TFLOP/s")
    save()


rc = 0
R["phase"] = "steps"
for spec in [s.strip() for s in args.shapes.split(",") if s.strip()]:
    try:
        run_shape(spec)
    except Exception as e:
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        S = R["shapes"].setdefault(spec, {})
        S["ok"] = False
        S["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        S["oom"] = oom
        S["vram_at_error"] = vram()
        R["errors"].append({"phase": f"steps {spec}", "type": type(e).__name__, "msg": str(e)[:3000],
                            "tb": traceback.format_exc()[-3000:]})
        log(f"{spec}: {'OOM' if oom else 'FAILED'}: {str(e)[:300]}")
        rc = max(rc, 2 if oom else 1)
        opt.zero_grad(set_to_none=True)
        if CUDA:
            torch.cuda.empty_cache()
        save()
R["phase"] = "done"
save()
sys.exit(rc)
