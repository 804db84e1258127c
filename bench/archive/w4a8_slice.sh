#!/usr/bin/env bash
# One GPU call, from the repository root with .bench-carry/ (bench/fullsize.py pack) carried: one
# LoRA step of the full-size model at 512 px (bench/train_step.py, 10 timed steps per child,
# uncapped), bf16 weights against int4_w4a8 FP8 with each GEMM at several weight-slice sizes
# (model_kwargs int4_chunk_mib: train_step's --kernel flags), then the self-test's trainer side
# with the time it takes. Within BUDGET seconds (default 470). Results: $OUT/<label>.json and .log,
# $OUT/selftest.json.
#   OUT=OUT bash bench/archive/w4a8_slice.sh [LABEL ...]   (labels: below; given labels skip the self-test)
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TRITON_CACHE_AUTOTUNING=1
END=$(( $(date +%s) + ${BUDGET:-470} ))
S=.bench-site; mkdir -p $S && tar xJf .bench-carry/site.tar.xz -C $S && tar xJf .bench-carry/trainer.tar.xz -C $S
export PYTHONPATH=$PWD/$S/site:$PWD
T=$S/trainer
step() {  # label weights [train_step arguments ...]
  local label=$1 weights=$2; shift 2
  local left=$(( END - $(date +%s) )); [ $left -lt 45 ] && { echo "skip $label"; return; }
  [ $left -gt 110 ] && left=110
  echo "== $label $(date +%T)"
  timeout $left python3 -m bench.train_step --trainer $T --weights $weights --shapes 512 --steps 10 \
    --tag $label --out $OUT/$label.json "$@" > $OUT/$label.log 2>&1
  echo "rc $? $(date +%T)"
  python3 -c "import json,statistics;r=json.load(open('$OUT/$label.json'));s=r['shapes']['512']['steps'];print('$label median', round(statistics.median(x['total_s'] for x in s),4), 'n', len(s))" 2>&1 | tail -1
}
# LABEL: bf16[_anything], or triton_cN / scaled_cN (that GEMM with N MiB slices)
labels=("$@"); [ $# -eq 0 ] && labels=(bf16 triton_c64 triton_c512 scaled_c64 scaled_c512 triton_c256)
for label in "${labels[@]}"; do
  case $label in
    bf16*) step "$label" bf16 ;;
    triton_c*) step "$label" int4_w4a8 --kernel w4a8_activations=fp8 --kernel w4a8_gemm=triton \
                 --kernel int4_chunk_mib="${label#triton_c}" ;;
    scaled_c*) step "$label" int4_w4a8 --kernel w4a8_activations=fp8 --kernel w4a8_gemm=scaled_mm \
                 --kernel int4_chunk_mib="${label#scaled_c}" ;;
    *) echo "unknown label $label (bf16*, triton_cN, scaled_cN)"; exit 2 ;;
  esac
done
[ $# -gt 0 ] && exit 0  # the self-test runs with the default list only
left=$(( END - $(date +%s) ))
if [ $left -gt 60 ]; then
  echo "== selftest (trainer side) $(date +%T), $left s left"; start=$(date +%s)
  timeout $left python3 -m launcher.in_trainer.selftest.runner --trainer $T --out $OUT/selftest.json > $OUT/selftest.log 2>&1
  echo "selftest rc $? in $(( $(date +%s) - start )) s"; tail -25 $OUT/selftest.log
fi
