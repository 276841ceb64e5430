#!/usr/bin/env bash
# The session of 10:40 (2026-11-29), one H200, one lane a device command (logs under /tmp/next14/<lane>, packed into
# $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next14.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# prof: where a cold causal LM's optimize goes (#56's 30 s for 1B-4B shapes; the Qwen2-0.5B batch-1 LM 74.9 s in
#     next13.sh ab), py-spy over a cold optimize in a process of its own, then the same model warm (its caches) with
#     no profiler: the warm figure after this session's one code generation a launchers' copy and Triton's key early;
#     BERT the same, without the profiler; carry `.whl` (py-spy's wheel)
set -u
lane=$1
. bench/steps.sh; steps_start /tmp/next14/$lane "${2:-570}"
case $lane in
prof) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl > $O/whl.log 2>&1
    PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"
    W=$(mktemp -d); E="ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton TORCHINDUCTOR_CACHE_DIR=$W/inductor"
    m=qwen2-0.5b-lm-b1
    step 0 cold-$m 200 env $E "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/cold-$m.txt \
        -- python bench/optimize_time.py --side accelc_cold --model $m --workdir $W
    gzip -f $O/cold-$m.txt
    step 0 warm-$m 100 env $E python bench/optimize_time.py --side accelc_warm --model $m --workdir $W
    W=$(mktemp -d); E="ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton TORCHINDUCTOR_CACHE_DIR=$W/inductor"
    step 0 cold-bert 120 env $E python bench/optimize_time.py --side accelc_cold --model bert --workdir $W
    step 0 warm-bert 80 env $E python bench/optimize_time.py --side accelc_warm --model bert --workdir $W ;;
esac
tar czf $OUT/$lane.tgz -C $O .
