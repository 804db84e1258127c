#!/usr/bin/env bash
# FLUX.2 klein at full width through `python -m launcher run` (bench/fullsize.py launch) on one GPU
# machine: random weights of klein's real shapes (transformer and Qwen3 encoder, `prepare --model`),
# the shipped preset presets/MODEL_512.yaml on the upstream-main checkout of .bench-carry. Run from
# the repository root there; the labels run in the order given, and say what each launch is:
#   first_CAP_PX     every cache emptied (text, quantized), then the preset: text phase, quantization
#   relaunch_CAP_PX  the same launch again, the caches warm
#   bf16_PX          bf16 weights, uncapped, memory plan off (checkpointing everywhere): the reference
#   suffixes, any of: _mN  the memory plan's VRAM margin N GiB instead of the preset's 1 (vram_margin_gib):
#                          also a smaller card's plan with more room left free (15_512_m5 plans as 11_512)
#                     _pN  profile N steps (`run --profile N`: the step breakdown in LABEL.json)
#                     _sN  N steps instead of 10 (7 above 512 px)
#                     _c   blocks compiled (compile_blocks: true; Inductor's cache is the machine's, shared
#                          by the launches of one call)
# CAP is the card's free VRAM in GiB (klein is not cut down, so the cap is the card's: 22, 15, 11, 7
# for 24, 16, 12 and 8 GB cards, bench/card_cap.py's --free-gib); 4-bit launches use what the
# self-test picks on NVIDIA (int4_w4a8, FP8 through torch._scaled_mm, overlapped streaming),
# uncompiled, with the preset's memory plan.
#   R=RAMDISK/R M=DISK/m OUT=OUT [DEADLINE=EPOCH] bash bench/klein_run.sh klein9b first_22_512 relaunch_7_512 bf16_512
# The model is prepared once per R (R/MODEL/prepared); a launch that exits 0 leaves R/MODEL/done/LABEL
# and is not run again; DEADLINE skips a launch whose limit would pass it. Results: OUT/LABEL.json,
# .log, .run.json (python -m bench.klein_table OUT makes the table).
set -u
R=${R:?set R: a folder on a RAM disk} M=${M:?set M: a folder on a disk with 25 GiB free} OUT=${OUT:?set OUT}
MODEL=${1:?klein9b or klein4b}; shift
ROOT=$R/$MODEL
export PYTHONUNBUFFERED=1
if [[ ! -e $ROOT/prepared ]]; then
  echo "=== prepare $MODEL ($(date -u +%T))"
  python3 -m bench.fullsize prepare --carry .bench-carry --root "$ROOT" --model-dir "$M/$MODEL" --model "$MODEL" \
    --image-size 1024 > "$OUT/prepare_$MODEL.log" 2>&1 || { tail -30 "$OUT/prepare_$MODEL.log"; exit 1; }
  touch "$ROOT/prepared"; tail -8 "$OUT/prepare_$MODEL.log"
fi
KW=model.model_kwargs
PICK=(--set model.qtype int4_w4a8 --set $KW.w4a8_activations fp8 --set $KW.w4a8_gemm scaled_mm
      --set $KW.stream_mode overlapped --set $KW.compile_blocks false)
BF16=(--cap-gib 0 --set $KW.memory_plan "'off'" --set model.quantize false --set model.qtype uint4
      --set $KW.quantized_cache false --set $KW.compile_blocks false)
for label in "$@"; do
  IFS=_ read -r -a part <<< "$label"
  kind=${part[0]}
  if [[ $kind == bf16 ]]; then cap=0 px=${part[1]} extras=("${part[@]:2}"); else cap=${part[1]} px=${part[2]} extras=("${part[@]:3}"); fi
  case $kind in
    first) args=(--cap-gib "$cap" "${PICK[@]}"); limit=360 ;;
    relaunch) args=(--cap-gib "$cap" "${PICK[@]}"); limit=150 ;;
    bf16) args=("${BF16[@]}"); limit=200 ;;
    *) echo "unknown label $label: first_CAP_PX, relaunch_CAP_PX or bf16_PX"; exit 2 ;;
  esac
  steps=$(( px > 512 ? 7 : 10 ))
  for extra in "${extras[@]}"; do
    case $extra in
      m*) args+=(--set $KW.vram_margin_gib "${extra#m}") ;;
      p*) args+=(--profile "${extra#p}"); limit=$(( limit + 60 )) ;;
      s*) steps=${extra#s} ;;
      c) args+=(--set $KW.compile_blocks true); limit=$(( limit + 240 )) ;;
      *) echo "unknown suffix _$extra of $label: _mN, _pN, _sN or _c"; exit 2 ;;
    esac
  done
  if [[ -e $ROOT/done/$label ]]; then echo "=== $label: done in an earlier call"; continue; fi
  if [[ -n ${DEADLINE:-} ]] && (( $(date +%s) + limit > DEADLINE )); then
    echo "=== $label: skipped, its $limit s would pass DEADLINE"; continue; fi
  [[ $kind == first ]] && rm -rf "$ROOT/wd/cache/quantized" "$ROOT/wd/cache/text"
  echo "=== $label ($(date -u +%T))"
  timeout "$limit" python3 -m bench.fullsize launch --root "$ROOT" --model-dir "$M/$MODEL" \
    --preset "presets/${MODEL}_512.yaml" --label "$label" --steps "$steps" --set datasets.0.resolution "[$px]" \
    --launcher-set telemetry "{interval_s: 0.1}" "${args[@]}" --json-out "$OUT/$label.json" > "$OUT/$label.log" 2>&1
  rc=$?; echo "rc $rc ($(date -u +%T))"; tail -c 400 "$OUT/$label.log"; echo
  (( rc == 0 )) && mkdir -p "$ROOT/done" && touch "$ROOT/done/$label"
  cp "$ROOT/runs/$label"/*/*/run.json "$OUT/$label.run.json" 2>/dev/null
done
exit 0
