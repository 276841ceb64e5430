#!/usr/bin/env bash
# What the session of 06:21 (2026-11-29) leaves owed for a one-GPU H200, one lane a device command (logs under
# /tmp/next11/<lane>, packed into $OUT/<lane>.tgz); every lane's processes keep Python's bytecode (bench/steps.sh).
#   bash bench/results/runs/lanes-2026-11-29/next11.sh LANE [SECONDS]     # SECONDS: the command's budget (570)
# opt: #56's cold and warm figures at this tree against reduce-overhead's first call, for three e2e models (BERT,
#      ResNet-50, the Llama 1.1B shape): optimize_time.py's compile_ro, accelc_cold, accelc_warm (after c7a0e79's
#      guard batch and 988ae6c's worker record; run17's warm profile the before)
# regress: the e2e regression check with ONNX Runtime at its best (carry `.ort`: `cp -r ../shared/tools/ort-gpu
#      .ort`), after c7a0e79, as next8.sh e2e ran it at 1714607
# (the 8B shape's one-GPU HF side stays next8.sh tp8b; the multi-GPU runs next9.sh)
set -u
lane=$1
. bench/steps.sh; steps_start /tmp/next11/$lane "${2:-570}"
case $lane in
opt) for m in bert resnet50 llama; do
         step 0 opt-$m 185 python bench/optimize_time.py --models $m --sides compile_ro,accelc_cold,accelc_warm \
             --out $O/opt
     done ;;
regress) sides=compile_ro,accelc
     [ -f .ort/install.sh ] && source .ort/install.sh > $O/ort-install.log 2>&1 && sides=compile_ro,ort_opt,accelc
     step 0 e2e 540 python bench/e2e.py --models bert,resnet50,llama --sides $sides --batches first --out $O/e2e ;;
esac
tar czf $OUT/$lane.tgz -C $O .
