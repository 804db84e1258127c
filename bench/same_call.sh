#!/usr/bin/env bash
# The 4-bit step against bf16 on one GPU machine, full width, through `python -m launcher run`
# (bench/fullsize.py launch). Run from the repository root on the GPU machine, one stage per call,
# the stages in order on the same machine (R and M must survive between them):
#   prepare  assets and venv (bench/fullsize.py prepare) beside `launcher selftest`, then the first
#            launch: the preset as shipped (qtype auto -> the self-test's pick, memory_plan auto,
#            compile_blocks auto) at the 22 GiB card's cap scaled to 44 blocks, which quantizes and
#            writes the cache
#   512      int4_w4a8 FP8 through torch._scaled_mm, uncompiled then with compiled blocks, then bf16
#            weights the same two ways, all uncapped with checkpointing everywhere (memory_plan off),
#            then the preset as shipped at the 22 GiB cap again (the caches now warm)
#   1024     int4_w4a8 FP8 through torch._scaled_mm uncompiled, then compiled (2 profiled steps: its
#            breakdown.json), bf16 uncompiled (2 profiled steps), the preset as shipped (the plan's
#            and the self-test's choices) at the 22 GiB cap, then bf16 compiled
#   fallback the fallback paths at full width, 512 px, uncompiled, uncapped with the memory plan off
#            (as 512 runs them): int4_fused as shipped (Triton dequantize + cuBLAS), then int4_fused
#            on its plain-PyTorch reference (int4_kernel: false, what a card without Triton runs),
#            int4_w4a8 with int8 then FP8 activations through the Triton GEMM (int8: the only 8-bit
#            path of an RDNA3 card), uint4 (torchao: `qtype: auto` without a passing self-test), then
#            bf16 (the 4-bit caches deleted first, for host memory).
#            The int4_fused and uint4 launches quantize and write their caches (int4_w4a8 reads
#            int4_fused's); the first one also runs the text phase.
#   first    the first launch and the relaunches as a new user meets them, int4_w4a8 through
#            torch._scaled_mm with the preset's memory plan: the first launch at a 16 GB card's cap
#            (text phase, quantization, cache write, blocks placed or pinned as they are built), its
#            relaunch, a 12 GB card's and a 22 GiB card's relaunch, the 12, 8 and 16 GB cards' at the
#            caps of bench/card_cap.py, the 22 GiB card with compiled blocks on cold then
#            warm Inductor and Triton caches, then 768 px on the 16 GB and 22 GiB caps; last, a new
#            user's first launch with compiled blocks (every cache emptied: text, quantized,
#            Inductor, Triton) at the 22 GiB cap, in a call of its own (its limit, 540 s, leaves
#            room for nothing else; one such launch stalled past 420 s inside a compile), and its relaunch
#   fidelity the same LoRA trained 50 steps (seed 42, the same data) on the bf16 base and on each
#            4-bit path, uncapped with the memory plan off and uncompiled, a telemetry row a step;
#            the 4-bit path the self-test picks once more with seed 43 (the yardstick) and bf16
#            once more with seed 42 (the GPU's run-to-run spread), then bench/lora_fidelity.py
#            compares each LoRA with the bf16 one: $OUT/lora_fidelity.json. Repeat the stage until
#            every launch is done (DEADLINE): three calls on an H200
#   stream   the small cards' streaming against the 22 GiB card's step, all compiled, int4_w4a8 through
#            torch._scaled_mm, the preset's memory plan, 512 px: a first launch (eager: quantizes and
#            writes the cache), then 22 GiB, the 12 and 8 GB cards at plan-matched caps overlapped, and
#            the 8 GB card serialized (every AMD card's mode)
#   held     the 4-bit step against bf16 as the memory plan spends a large card: uncapped, the preset's
#            plan (memory_plan auto: every block resident, activations kept, then int4_w4a8's 8-bit
#            weight copies held with what is left), int4_w4a8 through torch._scaled_mm: a first launch
#            (eager, plan off: quantizes and writes the cache), then compiled at 512 px with the copies,
#            bf16 compiled, the copies off (hold_8bit_copies false), then both uncompiled, both
#            compiled at 1024 px (prepare with 1024 px images: the prepare stage's), then both
#            compiled again at 512 px with 3 profiled steps (their breakdown.json)
#   R=RAMDISK/R M=DISK/m OUT=OUT bash bench/same_call.sh prepare   (then 512, then 1024)
# Labels after the stage run only those launches of it, e.g. `... 1024 w4a8_scaled_mm_compiled_1024`;
# `prepare none` prepares without its launch, and the 512 stage's first launch then quantizes and
# writes the cache itself (its limit allows for that; bf16's for a text phase that is not cached yet).
# SUFFIX=_x: each launch's label (done file, results, run folder) ends in _x; labels named after the
# stage still name the launches without it (the same launches again, after a change to the checkout).
# Results: $OUT/<label>.json (bench/fullsize.py launch), $OUT/<label>.log, $OUT/selftest.json.
# TE_MLP=N: `prepare` narrows the text encoder's MLP to N (bench/fullsize.py --te-mlp; 1024: 7.6 instead
# of 44 GiB, so about a sixth of its ~100 s build): the text phase runs faster, the steps do not change, so
# for stages that time steps (held, stream, 512, 1024), not for `first` (a new user's first launch).
# SKIP_SELFTEST=1: `prepare` does not run `launcher selftest` (launches that name their qtype and
# set compile_blocks and the memory plan do not read it; `qtype: auto` and `auto` settings do).
# The kernel of each launch is its model_kwargs (w4a8_activations, w4a8_gemm, int4_kernel: `--set
# model.model_kwargs.KEY VALUE`, see flux2_contract/settings.py); what a launch leaves unset, `run`
# resolves from the self-test (or the qtype's defaults).
# DEADLINE=EPOCH_SECONDS: a launch whose limit would end after it is skipped, so that one GPU call
# can chain stages (`prepare none; fallback`) and stop inside its own limit. A launch that exits 0
# leaves R/done/<label>, and a later call of the same stage skips it: repeat the stage until done.
set -u
R=${R:?set R: a folder on a RAM disk (the text encoder is 44 GiB)} M=${M:?set M: a folder on a disk with 50 GiB free}
export PYTHONUNBUFFERED=1
BASE=(--root "$R" --model-dir "$M" --preset presets/rtx4090_512.yaml
      --set model.model_kwargs.flux2_params "{depth_single_blocks: 36}" --launcher-set telemetry "{interval_s: 0.1}")
OFF=(--cap-gib 0 --set model.model_kwargs.memory_plan "'off'")
EAGER=(--set model.model_kwargs.compile_blocks false)
COMPILED=(--set model.model_kwargs.compile_blocks true)
W4A8=(--set model.qtype int4_w4a8)
KW=model.model_kwargs
FP8=(--set $KW.w4a8_activations fp8)
INT8=(--set $KW.w4a8_activations int8)
SCALED=("${FP8[@]}" --set $KW.w4a8_gemm scaled_mm)  # torch._scaled_mm multiplies FP8 only
TRITON=(--set $KW.w4a8_gemm triton)
REFERENCE=(--set $KW.int4_kernel false)  # the plain-PyTorch path of the 4-bit Linears
INT4=(--set model.qtype int4_fused)
UINT4=(--set model.qtype uint4)
BF16=(--set model.quantize false --set model.qtype uint4 --set model.model_kwargs.quantized_cache false)
CAP22=18.8  # a 22 GiB card's cap less the 12 of 56 blocks this run leaves out (as in RESULTS.md)
CAP16=11.8  # a 16 GB card's (~15 GiB free), the same way
CAP12=8.3   # a 12 GB card's (~11 GiB free)
# Caps at which the 44-block model plans as the full model does on the card (bench/card_cap.py):
# the rule above takes the left-out blocks' bytes off twice where the full model would stream them
CAP16M=12.8  # python -m bench.card_cap --free-gib 15
CAP12M=9.55  # --free-gib 11
CAP8M=6.3    # --free-gib 7: an 8 GB card (RTX 4060 / 3070, RX 7600)

ONLY=" ${*:2} "
launch() {  # label px steps seconds args...
  local label=$1 px=$2 steps=$3 limit=$4; shift 4
  [[ $ONLY == "  " || $ONLY == *" $label "* ]] || return 0
  label+=${SUFFIX:-}
  if [[ -e $R/done/$label ]]; then echo "=== $label: done in an earlier call"; return 0; fi
  if [[ -n ${DEADLINE:-} ]] && (( $(date +%s) + limit > DEADLINE )); then
    echo "=== $label: skipped, its $limit s would pass DEADLINE"; return 0; fi
  echo "=== $label ($(date -u +%T))"
  timeout "$limit" python3 -m bench.fullsize launch "${BASE[@]}" --label "$label" --steps "$steps" \
    --set datasets.0.resolution "[$px]" "$@" --json-out "$OUT/$label.json" > "$OUT/$label.log" 2>&1
  local rc=$?; echo "rc $rc ($(date -u +%T))"; tail -c 400 "$OUT/$label.log"; echo
  (( rc == 0 )) && mkdir -p "$R/done" && touch "$R/done/$label"
  cp "$R/runs/$label"/*/*/run.json "$OUT/$label.run.json" 2>/dev/null
}

case ${1:?stage: prepare, 512, 1024, fallback, first, stream, held or fidelity} in
prepare)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -m bench.fullsize prepare --carry .bench-carry --root "$R" --model-dir "$M" --single-blocks 36 \
    --image-size 1024 ${TE_MLP:+--te-mlp "$TE_MLP"} > "$OUT/prepare.log" 2>&1 &
  if [[ ${SKIP_SELFTEST:-} == 1 ]]; then
    wait; echo "prepare rc $? ($(date -u +%T)), no self-test (SKIP_SELFTEST=1)"; tail -3 "$OUT/prepare.log"
    launch auto_first_512 512 10 360 --cap-gib "$CAP22"; exit 0
  fi
  until compgen -G "$R/wd/venv/lib/python3*/site-packages/zz_bench_vram_cap.pth" > /dev/null; do sleep 2; done
  start=$(date +%s)
  PYTHONPATH="$R/site" python3 -m launcher selftest --workdir "$R/wd" > "$OUT/selftest.log" 2>&1
  echo "selftest rc $? in $(( $(date +%s) - start )) s"; tail -40 "$OUT/selftest.log"
  cp "$R/wd/selftest.json" "$OUT/selftest.json"
  wait; echo "prepare done ($(date -u +%T))"; tail -3 "$OUT/prepare.log"
  launch auto_first_512 512 10 360 --cap-gib "$CAP22" ;;
512)
  launch w4a8_scaled_mm_512 512 10 290 "${OFF[@]}" "${W4A8[@]}" "${SCALED[@]}" "${EAGER[@]}"
  launch w4a8_scaled_mm_compiled_512 512 12 170 "${OFF[@]}" "${W4A8[@]}" "${SCALED[@]}" "${COMPILED[@]}"
  launch bf16_512 512 10 290 "${OFF[@]}" "${BF16[@]}" "${EAGER[@]}"
  launch bf16_compiled_512 512 12 200 "${OFF[@]}" "${BF16[@]}" "${COMPILED[@]}"
  launch auto_plan_512 512 10 100 --cap-gib "$CAP22" ;;
1024)
  launch w4a8_scaled_mm_1024 1024 7 110 "${OFF[@]}" "${W4A8[@]}" "${SCALED[@]}" "${EAGER[@]}"
  launch w4a8_scaled_mm_compiled_1024 1024 9 170 "${OFF[@]}" "${W4A8[@]}" "${SCALED[@]}" "${COMPILED[@]}" --profile 2
  launch bf16_1024 1024 9 180 "${OFF[@]}" "${BF16[@]}" "${EAGER[@]}" --profile 2
  launch auto_plan_1024 1024 6 100 --cap-gib "$CAP22"
  launch bf16_compiled_1024 1024 7 200 "${OFF[@]}" "${BF16[@]}" "${COMPILED[@]}" ;;
fallback)
  launch int4_fused_512 512 7 300 "${OFF[@]}" "${INT4[@]}" "${EAGER[@]}"
  launch int4_fused_reference_512 512 7 200 "${OFF[@]}" "${INT4[@]}" "${REFERENCE[@]}" "${EAGER[@]}"
  launch w4a8_int8_triton_512 512 7 130 "${OFF[@]}" "${W4A8[@]}" "${INT8[@]}" "${TRITON[@]}" "${EAGER[@]}"
  launch w4a8_fp8_triton_512 512 7 130 "${OFF[@]}" "${W4A8[@]}" "${FP8[@]}" "${TRITON[@]}" "${EAGER[@]}"
  launch uint4_512 512 7 280 "${OFF[@]}" "${UINT4[@]}" "${EAGER[@]}"
  # host memory: the text encoder on R, bf16's 50 GiB trainer and two 4-bit caches would not fit in 128 GiB
  [[ -e $R/done/uint4_512 ]] && rm -rf "$R/wd/cache/quantized"
  launch bf16_fallback_512 512 7 220 "${OFF[@]}" "${BF16[@]}" "${EAGER[@]}" ;;
first)
  PICK=("${W4A8[@]}" "${SCALED[@]}" --set model.model_kwargs.stream_mode overlapped)  # what selftest picks on NVIDIA
  [[ -e $R/done/first_16_512 ]] || rm -rf "$R/wd/cache/quantized" "$R/wd/cache/text"  # a new user's first launch
  launch first_16_512 512 8 300 --cap-gib "$CAP16" "${PICK[@]}" "${EAGER[@]}"
  launch relaunch_16_512 512 10 100 --cap-gib "$CAP16" "${PICK[@]}" "${EAGER[@]}"
  launch relaunch_12_512 512 10 160 --cap-gib "$CAP12" "${PICK[@]}" "${EAGER[@]}"
  launch relaunch_22_512 512 10 100 --cap-gib "$CAP22" "${PICK[@]}" "${EAGER[@]}"  # the step the 16 and 12 GB ones are held to
  launch relaunch_12_matched_512 512 10 160 --cap-gib "$CAP12M" "${PICK[@]}" "${EAGER[@]}"
  launch relaunch_8_matched_512 512 10 160 --cap-gib "$CAP8M" "${PICK[@]}" "${EAGER[@]}"
  launch relaunch_16_matched_512 512 10 100 --cap-gib "$CAP16M" "${PICK[@]}" "${EAGER[@]}"
  [[ -e $R/done/compiled_cold_22_512 ]] || rm -rf "$R/wd/cache/inductor" "$R/wd/cache/triton"
  launch compiled_cold_22_512 512 12 360 --cap-gib "$CAP22" "${PICK[@]}" "${COMPILED[@]}"
  launch compiled_warm_22_512 512 12 130 --cap-gib "$CAP22" "${PICK[@]}" "${COMPILED[@]}"
  launch relaunch_16_768 768 8 120 --cap-gib "$CAP16" "${PICK[@]}" "${EAGER[@]}"
  launch relaunch_22_768 768 8 120 --cap-gib "$CAP22" "${PICK[@]}" "${EAGER[@]}"
  if [[ ! -e $R/done/first_compiled_22_512 && ( $ONLY == "  " || $ONLY == *" first_compiled_22_512 "* ) ]]; then
    rm -rf "$R/wd/cache/quantized" "$R/wd/cache/text" "$R/wd/cache/inductor" "$R/wd/cache/triton"; fi
  launch first_compiled_22_512 512 12 540 --cap-gib "$CAP22" "${PICK[@]}" "${COMPILED[@]}"
  launch relaunch_compiled_22_512 512 12 130 --cap-gib "$CAP22" "${PICK[@]}" "${COMPILED[@]}" ;;
stream)
  PICK=("${W4A8[@]}" "${SCALED[@]}" --set $KW.stream_mode overlapped)
  launch stream_first_22_512 512 6 330 --cap-gib "$CAP22" "${PICK[@]}" "${EAGER[@]}"
  launch stream_22_512 512 12 240 --cap-gib "$CAP22" "${PICK[@]}" "${COMPILED[@]}"
  launch stream_12_512 512 12 160 --cap-gib "$CAP12M" "${PICK[@]}" "${COMPILED[@]}"
  launch stream_8_512 512 12 160 --cap-gib "$CAP8M" "${PICK[@]}" "${COMPILED[@]}"
  launch stream_8_serialized_512 512 12 200 --cap-gib "$CAP8M" "${W4A8[@]}" "${SCALED[@]}" \
    --set $KW.stream_mode serialized "${COMPILED[@]}" ;;
held)
  PICK=(--cap-gib 0 "${W4A8[@]}" "${SCALED[@]}")  # uncapped: the plan from the VRAM the card has free
  launch held_first_512 512 4 330 "${OFF[@]}" "${W4A8[@]}" "${SCALED[@]}" "${EAGER[@]}"
  launch held_w4a8_512 512 12 200 "${PICK[@]}" "${COMPILED[@]}"
  launch held_bf16_512 512 12 260 --cap-gib 0 "${BF16[@]}" "${COMPILED[@]}"
  launch held_w4a8_nocopies_512 512 12 170 "${PICK[@]}" --set $KW.hold_8bit_copies false "${COMPILED[@]}"
  launch held_w4a8_eager_512 512 8 150 "${PICK[@]}" "${EAGER[@]}"
  launch held_bf16_eager_512 512 8 240 --cap-gib 0 "${BF16[@]}" "${EAGER[@]}"
  launch held_w4a8_1024 1024 8 200 "${PICK[@]}" "${COMPILED[@]}"
  launch held_bf16_1024 1024 7 260 --cap-gib 0 "${BF16[@]}" "${COMPILED[@]}"
  launch held_w4a8_profile_512 512 8 200 "${PICK[@]}" "${COMPILED[@]}" --profile 3
  launch held_bf16_profile_512 512 8 260 --cap-gib 0 "${BF16[@]}" "${COMPILED[@]}" --profile 3 ;;
fidelity)
  STEPS=50
  ROWS=(--launcher-set telemetry "{interval_s: 0.1}" "${OFF[@]}" "${EAGER[@]}")  # a row each step (~0.5 s)
  launch fid_bf16 512 $STEPS 300 "${ROWS[@]}" "${BF16[@]}"
  launch fid_w4a8_fp8 512 $STEPS 300 "${ROWS[@]}" "${W4A8[@]}" "${SCALED[@]}"
  launch fid_int4_fused 512 $STEPS 150 "${ROWS[@]}" "${INT4[@]}"
  launch fid_w4a8_fp8_seed43 512 $STEPS 150 "${ROWS[@]}" "${W4A8[@]}" "${SCALED[@]}" --set training_seed 43
  launch fid_bf16_rerun 512 $STEPS 240 "${ROWS[@]}" "${BF16[@]}"  # bf16 twice: the GPU's own run-to-run spread
  launch fid_uint4 512 $STEPS 330 "${ROWS[@]}" "${UINT4[@]}"
  launch fid_w4a8_int8 512 $STEPS 150 "${ROWS[@]}" "${W4A8[@]}" "${INT8[@]}" "${TRITON[@]}"
  python3 -m bench.lora_fidelity compare "$R/runs" fid_bf16:fid_w4a8_fp8 fid_bf16:fid_int4_fused fid_bf16:fid_uint4 \
    fid_bf16:fid_w4a8_int8 fid_w4a8_fp8:fid_w4a8_fp8_seed43 fid_bf16:fid_w4a8_fp8_seed43 \
    fid_bf16:fid_bf16_rerun --out "$OUT/lora_fidelity.json" ;;
esac
