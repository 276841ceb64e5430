#!/usr/bin/env bash
# The session of 06:21 (2026-11-29), one H200, one lane a device command (logs under /tmp/next10/<lane>, packed into
# $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next10.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# ab: a cold optimize of Qwen2-0.5B's batch-1 LM and of BERT with this tree and with `base/` (the tree before the
#     guard's other sizes went to the compile workers at once; `base/` is that commit's accelc with passes/, kernels/
#     and models/ moved under it, first on PYTHONPATH), alternating, each side a process of its own (optimize_time.py)
# torchao: torchao's float8 under reduce-overhead beside accelc's fp8 on the Llama prefill shape and ViT-B, with
#     its error against fp32 (bench/e2e.py keeps its first output now); carry `.whl`
# warm: where a warm optimize goes (#56's 5 s / 10 s targets): BERT and the Qwen2-0.5B batch-1 LM optimized cold in
#     a process (filling its own caches), then again in a new process under py-spy with those caches (the verdicts
#     reused: optimize_time.py's accelc_warm side); carry `.whl` (py-spy's wheel)
set -u
lane=$1
. bench/steps.sh; steps_start /tmp/next10/$lane "${2:-570}"
case $lane in
ab) for m in qwen2-0.5b-lm-b1 bert; do
        step 0 new-$m 200 python bench/optimize_time.py --models $m --sides accelc_cold --out $O/new
        step 0 base-$m 200 env PYTHONPATH=$PWD/base python bench/optimize_time.py --models $m --sides accelc_cold \
            --out $O/base
    done ;;
torchao) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
             .whl/*.whl > $O/whl.log 2>&1
    step 0 fp8 560 env PYTHONPATH=/tmp/site python bench/e2e.py --models llama,vit_base \
        --sides accelc_fp8,torchao_fp8_ro --batches first --out $O/fp8 ;;
warm) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl > $O/whl.log 2>&1
    PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"
    for m in bert qwen2-0.5b-lm-b1; do
        W=$(mktemp -d); E="ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton TORCHINDUCTOR_CACHE_DIR=$W/inductor"
        step 0 cold-$m 200 env $E python bench/optimize_time.py --side accelc_cold --model $m --workdir $W
        step 0 warm-$m 120 env $E "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/warm-$m.txt \
            -- python bench/optimize_time.py --side accelc_warm --model $m --workdir $W
        gzip -f $O/warm-$m.txt
    done ;;
esac
tar czf $OUT/$lane.tgz -C $O .
