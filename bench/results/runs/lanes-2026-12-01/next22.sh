#!/usr/bin/env bash
# The session of 20:17 (2026-12-01): one H200, lanes a command (logs under /tmp/next22/<lane>, packed into
# $OUT/<lane>.tgz; the install, GPU list and bytecode prime once a command, in setup.tgz):
#   bash bench/results/runs/lanes-2026-12-01/next22.sh LANE[,LANE...] [SECONDS]   # SECONDS: the command's budget (570)
# lm (~130 s): the generation step's glue for other shapes compiled in the background, now that the speed optimize
#     measures on the example prompt no longer compiles it in the main thread first (regions.Glue.hold_later; before
#     it the thread found it compiled and never started: runs/lanes-2026-11-30's lm lane, +0.0 s in the background):
#     the Qwen2-1.5B batch-1 LM cold at the default against ACCELC_OTHER_SHAPES=now, caches of each its own
# lm05 (~100 s): the same for the Qwen2-0.5B batch-1 LM
# gtest (~140 s): tests/test_glue_later.py on the GPU (two failed at 42f8e16: the step's compile never started; the
#     paged step of a 3-layer Llama not cut into regions)
# plan (~30 s): diag_plan.py (why a tiny Llama's step is or is not cut into regions, static / paged, 3 / 4 layers)
# warm (~400 s): a warm optimize without the compile workers' start (618ac71: they start as a capture traces, so a
#     warm optimize whose graph is read back starts none) against its parent a186fc6 (16 workers importing beside it),
#     BERT and the Llama 1.1B shape, cold then warm in one process each, the two trees alternating (runs/
#     optimize_time/run40-h200: warm 4.4 / 7.5 s, the Llama shape's passes 1.38 s warm, 0.58 cold); make `base/`
#     first (untracked, removed after; never committed):
#     mkdir base && git archive a186fc6 accelc passes kernels models | tar x -C base && mv base/{passes,kernels,models} base/accelc
. bench/steps.sh
lane() { case $1 in
lm|lm05) m=$([ $1 = lm ] && echo qwen2-1.5b-lm-b1 || echo qwen2-0.5b-lm-b1)
    for o in background now; do
        step 0 $m-$o 100 env $(fresh) ACCELC_OTHER_SHAPES=$o python bench/optimize_time.py --models $m \
            --sides accelc_cold --out $O/$m-$o
    done ;;
gtest) step 0 gtest 200 python -m pytest -q -p no:cacheprovider tests/test_glue_later.py ;;
plan) step 0 plan 90 python bench/results/runs/lanes-2026-12-01/diag_plan.py ;;
warm) for m in bert llama; do
        cap=$([ $m = bert ] && echo 90 || echo 130)
        step 0 base-$m $cap env $(fresh) PYTHONPATH=$PWD/base python bench/optimize_time.py --models $m \
            --sides accelc_cold,accelc_warm --out $O/base-$m
        step 0 new-$m $cap env $(fresh) python bench/optimize_time.py --models $m --sides accelc_cold,accelc_warm \
            --out $O/new-$m
    done ;;
*) echo "no lane $1" > $O/error.log ;;
esac; }
lanes_run /tmp/next22 "$1" "${2:-570}"
