#!/usr/bin/env bash
# What the session of 13:38 (2026-11-29) leaves owed for a one-GPU H200, one lane a device command (logs under
# /tmp/next17/<lane>, packed into $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next17.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# ab: this session's cold-LM changes against their parent 18f1857: 025c1c3 + 1c89c97 (the generation step captured
#     in the forward's first wait for the compile workers, the forward's warm-up in the step's), 9e814f6 (the
#     greedy loop's kernels one binary each), 499e953 (a batch-1 program unlifted once), da601be (a layer's reference
#     without a deep copy), 8a33ab3 / 29bc1f8 (the guard's error figures read back once): a cold optimize of the Qwen2-0.5B batch-1 LM, each side a process with
#     empty caches, alternating, three pairs (next16.sh pair had one: 59.7 against 69.0 s); make `base/` first
#     (untracked, removed after; never committed):
#     mkdir base && git archive 18f1857 accelc passes kernels models | tar x -C base && mv base/{passes,kernels,models} base/accelc
# workers: diag_workers.py at this tree (what each wait for the compile workers waits on, now with each job's
#     constexprs: which flash-attention candidate takes the step's 5.5 s) on the Qwen2 LM, then BERT
# (also owed: next11.sh regress (carry .ort) and next11.sh opt at this tree; next15.sh lm8b and diag;
#  next13.sh pytest; next8.sh tp8b; next9.sh on an H200 x 4 host)
set -u
lane=$1
. bench/steps.sh; steps_start /tmp/next17/$lane "${2:-570}"
case $lane in
ab) for i in 1 2 3; do
        step 0 new-$i 95 python bench/optimize_time.py --models qwen2-0.5b-lm-b1 --sides accelc_cold --out $O/new-$i
        step 0 base-$i 95 env PYTHONPATH=$PWD/base python bench/optimize_time.py --models qwen2-0.5b-lm-b1 \
            --sides accelc_cold --out $O/base-$i
    done ;;
workers) for m in qwen2-0.5b-lm-b1 bert; do
        W=$(mktemp -d); step 0 workers-$m 150 env ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton \
            TORCHINDUCTOR_CACHE_DIR=$W/inductor python bench/results/runs/lanes-2026-11-29/diag_workers.py $m
    done ;;
esac
tar czf $OUT/$lane.tgz -C $O .
