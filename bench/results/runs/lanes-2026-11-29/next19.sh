#!/usr/bin/env bash
# What the session of 19:30 (2026-11-29) leaves owed for a one-GPU H200, one lane a device command (logs under
# /tmp/next19/<lane>, packed into $OUT/<lane>.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next19.sh LANE [SECONDS]      # SECONDS: the command's budget (570)
# in order of what they decide: bg, export, bgwarm, bgreq (then the default of other_shapes), fam1, fam2, b16, load,
# bgtest
# bg: 674082e's OptimizeConfig(other_shapes="background") (ACCELC_OTHER_SHAPES=background: the glue for other shapes
#     compiled in a thread after optimize returns) against "now", cold BERT / the Llama 1.1B shape / ResNet-50, one
#     process a side with empty caches, alternating now / background: optimize_s, other_shapes_after_s (the wait
#     for that thread), call_ms after it (the same program: nothing lost)
# bgwarm: the same with a warm side after each cold one (the caches and verdicts cold left), background only, BERT and
#     ResNet-50 (run33's "now": warm 8.5 / 6.0 s, #56's target 5)
# bgreq: bench/first_requests.py on BERT with the background compile in flight (its first 40 requests of random batch
#     and length, each one's ms and what was logged: a plain call while it compiles, no request waiting for a
#     compile) against "now"
# load: cold, warm and accelc.load + the first call served of BERT at this tree (the README's "about 4 s" is run6's,
#     2026-11-27; #56's target 3 s)
# fam1 / fam2: #60's three more causal LMs of 1B-4B parameters, other families (bench/generate.py's qwen2-1.5b,
#     gemma-2b, phi3-mini shapes, random weights): batch-1 decode, accelc against HF's static cache + compile, the
#     share of the copy limit
# b16: batch 16 against HF's static cache + compile (#60: at least 1.5x), TinyLlama and Qwen2-0.5B
# export: 335a3c3 + 2bd2f90 (accelc/capture/lean_export.py: torch 2.11's export told not to collect FX stack traces,
#     and its passes' graph modules generating their code lazily) against c788d38, cold Qwen2-0.5B b1 LM, two pairs
#     (the forward's "capture" and the step's capture are where it shows); make `base/` first (untracked, removed after):
#     mkdir base && git archive c788d38 accelc passes kernels models | tar x -C base && mv base/{passes,kernels,models} base/accelc
# bgtest: the background compile's tests on the GPU (its own CUDA stream, a capture waiting for it, a call at another
#     shape meanwhile plain), then test_regions, test_runner and test_glue_later with 8 workers
# (also owed: next18.sh workers and profile; next15.sh diag; next8.sh tp8b; next9.sh on an H200 x 4 host)
set -u
lane=$1
. bench/steps.sh; steps_start /tmp/next19/$lane "${2:-570}"
case $lane in
bg) for m in bert llama resnet50; do
        for o in now background; do
            step 0 $m-$o 95 env ACCELC_OTHER_SHAPES=$o python bench/optimize_time.py --models $m --sides accelc_cold \
                --out $O/$m-$o
        done
    done ;;
bgwarm) for m in bert resnet50; do
        step 0 $m-warm 200 env ACCELC_OTHER_SHAPES=background python bench/optimize_time.py --models $m \
            --sides accelc_cold,accelc_warm --out $O/$m-warm
    done ;;
bgreq) for o in background now; do
        step 0 bert-$o 200 env ACCELC_OTHER_SHAPES=$o python bench/first_requests.py --model bert --requests 40 \
            --out $O/bert-$o
    done ;;
load) step 0 bert-load 300 python bench/optimize_time.py --models bert --sides accelc_cold,accelc_warm,load --out $O/load ;;
fam1) for m in qwen2-1.5b gemma-2b; do
        step 0 $m 270 python bench/generate.py --models $m --batches 1 --sides accelc,hf_static_compile --out $O/$m
    done ;;
fam2) step 0 phi3-mini 540 python bench/generate.py --models phi3-mini --batches 1 --sides accelc,hf_static_compile \
        --out $O/phi3-mini ;;
b16) for m in tinyllama qwen2-0.5b; do
        step 0 $m-b16 270 python bench/generate.py --models $m --batches 16 --sides accelc,hf_static_compile --out $O/$m
    done ;;
export) for i in 1 2; do
        step 0 new-$i 95 python bench/optimize_time.py --models qwen2-0.5b-lm-b1 --sides accelc_cold --out $O/new-$i
        step 0 base-$i 95 env PYTHONPATH=$PWD/base python bench/optimize_time.py --models qwen2-0.5b-lm-b1 \
            --sides accelc_cold --out $O/base-$i
    done ;;
bgtest) step 0 glue-later 120 env ACCELC_AUTOTUNE=0 python -m pytest -q -n 0 -p no:cacheprovider tests/test_glue_later.py
    step 0 pytest 400 env ACCELC_AUTOTUNE=0 python -m pytest -q -n 8 -p no:cacheprovider tests/test_regions.py \
        tests/test_runner.py tests/test_glue_later.py tests/test_dynamic_shapes.py ;;
esac
tar czf $OUT/$lane.tgz -C $O .
