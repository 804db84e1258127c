#!/bin/bash
# One GPU call for the 8-bit-activation figures of RESULTS.md ("8-bit activations"), from the
# repository root, with `.bench-carry/trainer` (bench/carry.py) and `.whl` (torchao, optimum-quanto)
# carried. In order, within BUDGET seconds (default 540):
#   1. the self-test, trainer side (kernels vs reference, quality gate, 3 tiny steps per path,
#      block-Linear time at 512 and 1024 px: bf16 vs every path) -> $OUT/selftest.json
#   2. the W4A8 quality gate at full FLUX.2 block shapes -> $OUT/w4a8_quality.json
#   3. one LoRA step of the full-size model at 512 px, through bench/train_step.py: int4_w4a8
#      (with the kernel model_kwargs of the self-test's fastest path, `fastest.kernel`, as
#      train_step's --kernel flags; none where it was not int4_w4a8: the qtype's defaults) and
#      int4_fused capped at 24 GiB, bf16
#      uncapped -> $OUT/step_<qtype>.json
# Triton's cache is shared by all of them (TRITON_CACHE_AUTOTUNING=1): the steps reuse the
# self-test's compiled kernels and tuning at the same shapes.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=$PWD/.bench-triton TRITON_CACHE_AUTOTUNING=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .bench-site .whl/*.whl || exit 3
export PYTHONPATH=$PWD/.bench-site:$PWD
LOG=$OUT/all.log
END=$(( $(date +%s) + ${BUDGET:-540} ))
left() { local l=$(( END - $(date +%s) )); [ $l -gt $1 ] && echo $1 || echo $l; }
stamp() { echo "== $(date -u +%T) $*" | tee -a $LOG; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu,power.draw --format=csv,noheader
  python3 -c "import torch, triton, torchao; print('torch', torch.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__)"; } 2>&1 | tee -a $LOG
stamp selftest
timeout $(left 200) python3 -m launcher.in_trainer.selftest.runner --trainer .bench-carry/trainer --out $OUT/selftest.json \
  --tokens "1024,512;4096,512" 2>&1 | grep -v -i "warn" | cut -c1-400 | tee -a $LOG
stamp "selftest rc=$?"
KERNEL=$(python3 -c "
import json
f = json.load(open('$OUT/selftest.json')).get('fastest') or {}
if f.get('qtype') == 'int4_w4a8':
    print(' '.join(f'--kernel {k}={v}' for k, v in (f.get('kernel') or {}).items()))" 2>/dev/null)
stamp "W4A8 path: ${KERNEL:-the defaults of int4_w4a8}"
timeout $(left 80) python3 -m bench.w4a8_quality --trainer .bench-carry/trainer --out $OUT/w4a8_quality.json 2>&1 \
  | cut -c1-400 | tee -a $LOG
stamp "quality rc=$?"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for spec in "int4_w4a8 --cap-gib 24 $KERNEL" "bf16" "int4_fused --cap-gib 24"; do
  set -- $spec; q=$1; shift
  t=$(left 110); [ "$t" -lt 40 ] && { stamp "skip $q: $t s left"; continue; }
  stamp "step $q"
  timeout $t python3 -m bench.train_step --trainer .bench-carry/trainer --weights $q --shapes 512 --steps 5 "$@" \
    --tag ${q}_512 --out $OUT/step_$q.json 2>&1 | grep -E "RESULT|FAIL|OOM|weights ready|warm-up|Error" | cut -c1-300 | tee -a $LOG
done
stamp done
