#!/usr/bin/env bash
# What the session of 01:19 (2026-11-30) leaves owed for a one-GPU H200 (logs under /tmp/next21/<lane>, packed into
# $OUT/<lane>.tgz; the install, GPU list and bytecode prime once a command, in setup.tgz):
#   bash bench/results/runs/lanes-2026-11-30/next21.sh LANE[,LANE...] [SECONDS]   # SECONDS: the command's budget (570)
# Lengths there (H200, estimated): lm ~300 s, gen ~150, opt ~320, dyn ~150, gtest ~160, profr ~90, lm8b ~200,
# capw ~260.
# regress ~300 (carry `.ort`).
# in order of what they decide: regress, lm, gen, opt, lm8b, dyn, gtest, profr, capw
# regress (carry `.ort`): the e2e check at this tree (the background default, the step's compile in the background:
#     bench/e2e.py waits for both before timing) against reduce-overhead and ONNX Runtime (run53 was at 1de7b61)
# lm: a causal LM's generation step's glue for other shapes compiled in the background on copies of its cache (this
#     session's change: the step had compiled it inside optimize, 8.0 s of the Qwen2-1.5B LM's 57.8 s in
#     runs/optimize_time/run37-h200-families-cold/) against ACCELC_OTHER_SHAPES=now, cold, Qwen2-0.5B and Qwen2-1.5B
#     batch-1 LMs, one process a side, caches of each its own: optimize_s, other_shapes_after_s (the wait after it)
# gen: Qwen2-0.5B batch-1 decode at the default, against HF's static cache + compile: the step's decode as before
#     (runs/generate/run38-h200), other_shapes_after_s in the JSON (generate.py waits for it before timing)
# opt: cold and warm optimize against reduce-overhead at the new default (other_shapes="background"), BERT /
#     ResNet-50 / Llama 1.1B: #56's ratio with it (runs/optimize_time/run39-h200 measured it at "now": 2.1x-2.4x)
# lm8b: the Llama-3-8B shape's LM cold and warm at the default (run31-h200-8b: 68.8 / 12.5 s at "now", its step's
#     glue compiled inside: #56's 60 / 10 s)
# dyn: bench/dynamic.py's 300-request trace of BERT right after optimize at the default (#56: none above 1 s)
# profr (carry `.whl`: py-spy): ResNet-50's cold optimize under py-spy (bench/spy_summary.py reads it): the e2e
#     model furthest from #56's 1.5x (2.43x in run39; its guard 13.8 s and layer timing 3.5 s with the shipped table
#     holding its keys), not profiled before
# capw: whether the compile workers' start (16 processes importing torch and triton as optimize begins) slows the
#     capture beside it: cold BERT and the Qwen2-1.5B LM with the workers (the default) and without
#     (ACCELC_COMPILE_PROCS=0), caches of their own; the capture phase of each (run8-h200-compile-workers, before
#     the kept bytecode: BERT 7.47 s with them, 4.05 without; run37's Qwen2-1.5B capture 12.9 s, its profile's 6.3)
# gtest: tests/test_glue_later.py on the GPU (the step's compile on copies of its cache, the waits of save, pickle,
#     deep copy, release_graphs and the report)
set -u
. bench/steps.sh; steps_start /tmp/next21/setup "${2:-570}"
tar czf $OUT/setup.tgz -C $O .
for lane in ${1//,/ }; do
O=/tmp/next21/$lane; mkdir -p $O
case $lane in
regress) sides=compile_ro,accelc
    [ -f .ort/install.sh ] && source .ort/install.sh > $O/ort-install.log 2>&1 && sides=compile_ro,ort_opt,accelc
    step 0 e2e 540 python bench/e2e.py --models bert,resnet50,llama --sides $sides --batches first --out $O/e2e ;;
lm) for m in qwen2-0.5b-lm-b1 qwen2-1.5b-lm-b1; do
        for o in background now; do
            step 0 $m-$o 100 env $(fresh) ACCELC_OTHER_SHAPES=$o python bench/optimize_time.py --models $m \
                --sides accelc_cold --out $O/$m-$o
        done
    done ;;
gen) step 0 qwen2-0.5b 240 python bench/generate.py --models qwen2-0.5b --batches 1 --sides accelc,hf_static_compile \
        --out $O/qwen2-0.5b ;;
opt) for m in bert resnet50 llama; do
        step 0 opt-$m 185 python bench/optimize_time.py --models $m --sides compile_ro,accelc_cold,accelc_warm \
            --out $O/opt
    done ;;
lm8b) step 0 lm8b 300 python bench/optimize_time.py --models llama3-8b-lm --sides accelc_cold,accelc_warm --out $O/opt ;;
dyn) step 0 dyn-bert 240 python bench/dynamic.py --models bert --requests 300 --sides eager,accelc --out $O/dyn ;;
profr) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/py_spy*.whl > $O/whl.log 2>&1
    PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"
    W=$(mktemp -d)
    step 0 cold-resnet50 150 env ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton TORCHINDUCTOR_CACHE_DIR=$W/inductor \
        "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/cold-resnet50.txt \
        -- python bench/optimize_time.py --side accelc_cold --model resnet50 --workdir $W
    gzip -f $O/cold-resnet50.txt ;;
capw) for m in bert qwen2-1.5b-lm-b1; do
        for w in default 0; do
            step 0 $m-procs-$w 100 env $(fresh) $([ $w = 0 ] && echo ACCELC_COMPILE_PROCS=0) \
                python bench/optimize_time.py --models $m --sides accelc_cold --out $O/$m-procs-$w
        done
    done ;;
gtest) step 0 gtest 240 python -m pytest -q -p no:cacheprovider tests/test_glue_later.py ;;
*) echo "no lane $lane" > $O/error.log ;;
esac
tar czf $OUT/$lane.tgz -C $O .
done
