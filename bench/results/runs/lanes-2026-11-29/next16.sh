#!/usr/bin/env bash
# The session of 13:38 (2026-11-29), one H200, one lane a device command (logs under /tmp/next16/<lane>, packed into
# $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next16.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# prof: where a cold optimize goes at 18f1857 (next15.sh ab: the Qwen2-0.5B batch-1 LM 55.3 s, BERT 28.3 s): py-spy
#     over a cold optimize of each in a process of its own with empty caches; carry `.whl` (py-spy's wheel)
# ab: 025c1c3 (a causal LM's generation step captured in its forward's first wait for the compile workers) against
#     its parent 18f1857: a cold optimize of the Qwen2-0.5B batch-1 LM, each side a process, alternating, twice;
#     then diag_workers.py (what the waits for the compile workers wait on) on the same model with empty caches;
#     make `base/` first (untracked, removed after; never committed):
#     mkdir base && git archive 18f1857 accelc passes kernels models | tar x -C base && mv base/{passes,kernels,models} base/accelc
# pair: 1c89c97 (the step's capture in the forward's wait, the forward's warm-up in the step's) against the same
#     base/, one cold optimize of the Qwen2-0.5B batch-1 LM each (what this session's device time had left)
set -u
lane=$1
. bench/steps.sh; steps_start /tmp/next16/$lane "${2:-570}"
case $lane in
prof) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl > $O/whl.log 2>&1
    PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"
    for m in qwen2-0.5b-lm-b1 bert; do
        W=$(mktemp -d); E="ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton TORCHINDUCTOR_CACHE_DIR=$W/inductor"
        step 0 cold-$m 200 env $E "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/cold-$m.txt \
            -- python bench/optimize_time.py --side accelc_cold --model $m --workdir $W
        gzip -f $O/cold-$m.txt
    done ;;
ab) for i in 1 2; do
        step 0 new-$i 150 python bench/optimize_time.py --models qwen2-0.5b-lm-b1 --sides accelc_cold --out $O/new-$i
        step 0 base-$i 150 env PYTHONPATH=$PWD/base python bench/optimize_time.py --models qwen2-0.5b-lm-b1 \
            --sides accelc_cold --out $O/base-$i
    done
    W=$(mktemp -d); step 0 workers 150 env ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton \
        TORCHINDUCTOR_CACHE_DIR=$W/inductor python bench/results/runs/lanes-2026-11-29/diag_workers.py qwen2-0.5b-lm-b1 ;;
pair) step 0 new 130 python bench/optimize_time.py --models qwen2-0.5b-lm-b1 --sides accelc_cold --out $O/new
    step 0 base 130 env PYTHONPATH=$PWD/base python bench/optimize_time.py --models qwen2-0.5b-lm-b1 \
        --sides accelc_cold --out $O/base ;;
esac
tar czf $OUT/$lane.tgz -C $O .
