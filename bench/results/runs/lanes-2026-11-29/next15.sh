#!/usr/bin/env bash
# What the session of 10:40 (2026-11-29) leaves owed for a one-GPU H200, one lane a device command (logs under
# /tmp/next15/<lane>, packed into $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next15.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# ab: this session's cold-optimize changes against their parent 2f47cba: ac8d525 (the padding check's compiles
#     ahead reach the layers whose originals were released), 34c3b6b (the padded sizes compiled while the guard
#     checks), d4667c2 (the compile workers build the launchers), 85bd60b (no second pass for handed sizes),
#     130d3d5 (the heap frozen while optimizing), c819b87 (warm: one code
#     generation, Triton's key early): a cold optimize of the Qwen2-0.5B batch-1 LM and of BERT, each side a process, alternating; make
#     `base/` first (untracked, removed after; never committed):
#     mkdir base && git archive 2f47cba accelc passes kernels models | tar x -C base && mv base/{passes,kernels,models} base/accelc
# warm: the warm side of the same (cold then warm in one cache folder, each tree its own), BERT and the Qwen2 LM
# lm8b: the 8B shape's LM cold / warm at this tree (#56: 60 / 10 s; run21: 87.8 / 13.4)
# diag: diag_launchers.py (BERT and the Qwen2 LM cold: the launchers the main process still builds) and
#     diag_padding.py (the padding check's hand-overs printed), each in a process with empty caches
# (also owed: next11.sh regress, next11.sh opt, next13.sh pytest, next8.sh tp8b, next9.sh x 4)
set -u
lane=$1
# ab is next10.sh's lane as it stands (the same two models and sides; logs under /tmp/next10/ab, $OUT/ab.tgz)
[ "$lane" = ab ] && exec bash "$(dirname "$0")/next10.sh" ab "${2:-570}"
. bench/steps.sh; steps_start /tmp/next15/$lane "${2:-570}"
case $lane in
warm) for m in qwen2-0.5b-lm-b1 bert; do
        step 0 new-$m 240 python bench/optimize_time.py --models $m --sides accelc_cold,accelc_warm --out $O/new
        step 0 base-$m 240 env PYTHONPATH=$PWD/base python bench/optimize_time.py --models $m \
            --sides accelc_cold,accelc_warm --out $O/base
    done ;;
diag) for m in bert qwen2-0.5b-lm-b1; do
          W=$(mktemp -d); step 0 launchers-$m 200 env ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton \
              TORCHINDUCTOR_CACHE_DIR=$W/inductor python bench/results/runs/lanes-2026-11-29/diag_launchers.py $m
      done
      W=$(mktemp -d); step 0 padding 150 env ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton \
          TORCHINDUCTOR_CACHE_DIR=$W/inductor python bench/results/runs/lanes-2026-11-29/diag_padding.py ;;
lm8b) step 0 opt-llama3-8b-lm 560 python bench/optimize_time.py --models llama3-8b-lm --sides accelc_cold,accelc_warm \
          --out $O/opt ;;
esac
tar czf $OUT/$lane.tgz -C $O .
