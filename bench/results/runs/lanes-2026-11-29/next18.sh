#!/usr/bin/env bash
# What the session of 16:30 (2026-11-29) leaves owed for a one-GPU H200, one lane a device command (logs under
# /tmp/next18/<lane>, packed into $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next18.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# prefetch: #60's first try: the decode GEMVs ask L2 for their weights before their dependent-launch wait
#     (ACCELC_PREFETCH_WEIGHTS=1, kernels/pdl.py prefetch_rows; off by default) against without, TinyLlama batch 1
#     (two pairs, alternating) and Qwen2-0.5B (one pair): bench/generate.py's decode tok/s and share of the limit,
#     same tokens; the caches shared (only the first side optimizes cold: decode speed is what is compared)
# ab: this session's cold-path changes, 64f6682 (the greedy loop's kernels handed to the workers in one batch before
#     the step's optimize; they were four single-job waits at the end of a cold LM optimize, ~1.9 s) and the tuning
#     table without slow fillers (rebuild3-slow-fillers: the step's 5.5 s flash-attention compile out) and 1a27f78
#     (export without FX's stack traces, where this torch has the setting: fx-config.log says), against
#     2854280, cold Qwen2-0.5B b1 LM, three pairs; make `base/` first (untracked, removed after):
#     mkdir base && git archive 2854280 accelc passes kernels models | tar x -C base && mv base/{passes,kernels,models} base/accelc
# workers: diag_workers.py (fixed: it takes the wait's fill) on the Qwen2 LM with empty caches: the loop's kernels
#     now one early batch, not four late waits
# profile: TinyLlama's decode by kernel with the critical path (bench/tp.py's critical_path_us_per_token: each
#     kernel's own time, the dependent-launch waits left out; #60's question where the time beyond the weights'
#     bytes goes), with and without ACCELC_PREFETCH_WEIGHTS=1
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
ab) python -c "import torch, torch.fx.config as c; print(torch.__version__, 'do_not_emit_stack_traces:', hasattr(c, 'do_not_emit_stack_traces'))" > $O/fx-config.log 2>&1
    for i in 1 2 3; do
        step 0 new-$i 95 python bench/optimize_time.py --models qwen2-0.5b-lm-b1 --sides accelc_cold --out $O/new-$i
        step 0 base-$i 95 env PYTHONPATH=$PWD/base python bench/optimize_time.py --models qwen2-0.5b-lm-b1 \
            --sides accelc_cold --out $O/base-$i
    done ;;
workers) W=$(mktemp -d); step 0 workers-qwen2 150 env ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton \
        TORCHINDUCTOR_CACHE_DIR=$W/inductor python bench/results/runs/lanes-2026-11-29/diag_workers.py qwen2-0.5b-lm-b1 ;;
profile) for p in 0 1; do
        step 0 tinyllama-p$p 270 env ACCELC_PREFETCH_WEIGHTS=$p torchrun --nproc-per-node 1 bench/tp.py \
            --shape tinyllama --sides accelc --rounds 2 --prefill '' --out $O/tinyllama-p$p
    done ;;
pytest) step 0 pdl 120 python -m pytest -q -n 0 -p no:cacheprovider tests/test_pdl.py
    step 0 pytest 430 env ACCELC_AUTOTUNE=0 python -m pytest -q -n 8 -p no:cacheprovider tests/test_meanwhile.py \
        tests/test_capture_kept.py tests/test_shared_checks.py tests/test_reuse.py tests/test_guard.py ;;
esac
tar czf $OUT/$lane.tgz -C $O .
