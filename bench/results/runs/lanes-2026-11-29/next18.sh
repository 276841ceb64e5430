#!/usr/bin/env bash
# What the session of 16:30 (2026-11-29) leaves owed for a one-GPU H200, one lane a device command (logs under
# /tmp/next18/<lane>, packed into $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next18.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# prefetch: #60's first try: the decode GEMVs ask L2 for their weights before their dependent-launch wait
#     (ACCELC_PREFETCH_WEIGHTS=1, kernels/pdl.py prefetch_rows; off by default) against without, TinyLlama batch 1
#     (two pairs, alternating) and Qwen2-0.5B (one pair): bench/generate.py's decode tok/s and share of the limit,
#     same tokens; the caches shared (only the first side optimizes cold: decode speed is what is compared)
# pytest: tests/test_pdl.py on the GPU (the prefetching GEMV's bits against the plain one's), then the files
#     next13.sh pytest names and tests/test_meanwhile.py (the work done in the workers' waits, on the GPU)
# (also owed: next15.sh diag; next8.sh tp8b; next9.sh on an H200 x 4 host)
set -u
lane=$1
. bench/steps.sh; steps_start /tmp/next18/$lane "${2:-570}"
case $lane in
prefetch) for i in 1 2; do
        for p in 0 1; do
            step 0 tinyllama-p$p-$i 130 env ACCELC_PREFETCH_WEIGHTS=$p python bench/generate.py --models tinyllama \
                --batches 1 --sides accelc --out $O/tinyllama-p$p-$i
        done
    done
    for p in 0 1; do
        step 0 qwen2-p$p 100 env ACCELC_PREFETCH_WEIGHTS=$p python bench/generate.py --models qwen2-0.5b --batches 1 \
            --sides accelc --out $O/qwen2-p$p
    done ;;
pytest) step 0 pdl 120 python -m pytest -q -n 0 -p no:cacheprovider tests/test_pdl.py
    step 0 pytest 430 env ACCELC_AUTOTUNE=0 python -m pytest -q -n 8 -p no:cacheprovider tests/test_meanwhile.py \
        tests/test_capture_kept.py tests/test_shared_checks.py tests/test_reuse.py tests/test_guard.py ;;
esac
tar czf $OUT/$lane.tgz -C $O .
