#!/usr/bin/env bash
# What the session of 08:33 (2026-11-29) leaves owed for a one-GPU H200, one lane a device command (logs under
# /tmp/next13/<lane>, packed into $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next13.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# lm8b: #56's generation target (the Llama-3-8B shape: 60 s cold, 10 s warm) after a74c48b (the captured graphs
#     kept across processes: the forward's and the step's): optimize_time.py's accelc_cold, accelc_warm
#     (run19-h200-warm8b the before: 92.3 / 32.8 s)
# warm: where a warm optimize goes now that the capture is read back (run17 the before): BERT and the Qwen2-0.5B
#     batch-1 LM cold in a process, then warm under py-spy; carry `.whl` (py-spy's wheel)
# ab: the step sharing the forward's layer checks (8dc5125) against its parent (b24963e): a cold optimize of the
#     Qwen2-0.5B batch-1 LM and of the TinyLlama LM, each side a process, alternating; make `base/` first:
#     mkdir base && git archive b24963e accelc passes kernels models | tar x -C base && mv base/{passes,kernels,models} base/accelc
#     (untracked, removed after; never committed)
# pytest: this session's new paths on the GPU (kept captures, shared checks, reuse, the guard):
#     ACCELC_AUTOTUNE=0 pytest -n 8 over their test files
# (still owed beside these: next8.sh tp8b, the 8B shape's one-GPU HF side; next9.sh on an H200 x 4 host)
set -u
lane=$1
# warm is next10.sh's lane as it stands (its logs under /tmp/next10/warm, packed into $OUT/warm.tgz)
[ "$lane" = warm ] && exec bash "$(dirname "$0")/next10.sh" warm "${2:-570}"
. bench/steps.sh; steps_start /tmp/next13/$lane "${2:-570}"
case $lane in
ab) for m in qwen2-0.5b-lm-b1 tinyllama-lm; do
        step 0 new-$m 200 python bench/optimize_time.py --models $m --sides accelc_cold --out $O/new
        step 0 base-$m 200 env PYTHONPATH=$PWD/base python bench/optimize_time.py --models $m --sides accelc_cold \
            --out $O/base
    done ;;
lm8b) step 0 opt-llama3-8b-lm 560 python bench/optimize_time.py --models llama3-8b-lm --sides accelc_cold,accelc_warm \
          --out $O/opt ;;
pytest) step 0 pytest 560 env ACCELC_AUTOTUNE=0 python -m pytest -q -n 8 tests/test_capture_kept.py \
          tests/test_shared_checks.py tests/test_reuse.py tests/test_guard.py ;;
esac
tar czf $OUT/$lane.tgz -C $O .
