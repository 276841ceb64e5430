#!/usr/bin/env bash
# What the session of 22:17 (2026-11-29) leaves owed for a one-GPU H200 (logs under /tmp/next20/<lane>, packed into
# $OUT/<lane>.tgz; the install, GPU list and bytecode prime once a command, in setup.tgz):
#   bash bench/results/runs/lanes-2026-11-29/next20.sh LANE[,LANE...] [SECONDS]   # SECONDS: the command's budget (570)
# Several lanes in one command share its setup (~45 s a command: 7 commands of the session of 22:17 spent ~5 of its 30
# minutes on it); a lane's steps are cut at what is left of the budget. Their lengths there (H200): bgreq ~130 s,
# gemma ~400, regress ~350, tables ~400, cold15 ~300, prof15 ~200, opt ~450.
# in order of what they decide: bgreq, gemma, regress, tables, cold15, prof15, opt
# bgreq: BERT's first 40 requests with the glue for other shapes compiling in the background, now with the switch
#     interval lowered while it runs (f3bb111: run8 had two requests of 1.26 s and 0.55 s, the GIL's convoy), then
#     with "now"; each side with caches of its own, empty (run8's "now" had the first's); first_requests.py now waits
#     on the caller's stream and marks the requests the compile ran beside. If no request passes 1 s and the
#     marked ones stay near run8's 10-34 ms: other_shapes="background" becomes the default (cold optimize 6-15 s
#     shorter, runs/optimize_time/run34-h200-background/)
# gemma: Gemma's norm weight `1 + w` computed once (fold_weights) and the norms taken into the projections (this
#     session's norm_linear change) against c1537ad, Gemma-2B shape batch-1 decode (run40: 569.1 tok/s, 69% of the copy
#     limit), two pairs alternating, accelc only, caches of each side's own; make `base/` first (untracked,
#     removed after):
#     mkdir base && git archive c1537ad accelc passes kernels models | tar x -C base && mv base/{passes,kernels,models} base/accelc
# tables: every candidate raced (bench/tuning_table.py collect, ACCELC_TUNE=all) for the Qwen2-1.5B and Gemma-2B
#     shapes' batch-1 LMs, then `bench/tuning_table.py build` with runs/tuning_table/run1-h200 and run2-h200-b1's
#     races and these (their optimize 99.9 / 58.5 s in run40, the step's guard with tuning 42.1 / 18.4 s of it;
#     #56: 1B-4B shapes within 30 s cold): the table rebuilt, committed, then cold15
# tables4 (an H200 x 4 host instead: one model a GPU): the races of tables for the Qwen2-1.5B, Gemma-2B, Phi-3-mini,
#     Llama-3.2-1B, Llama-3.2-3B and Qwen2.5-3B shapes (bench/generate.py's), two rounds of four
# cold15: cold optimize of those two LMs against reduce-overhead's first call, after the table's rebuild
# prof15 (carry `.whl`: py-spy): the Qwen2-1.5B shape's batch-1 LM optimized cold under py-spy (runs/optimize_time/
#     run26-h200-cold-profile's method; bench/spy_summary.py reads it): where its 99.9 s go, the generation step's
#     guard (42.1 s against the forward's 22.5) and its layers' timing (9.7 s against Qwen2-0.5B's ~1.3) first; ~200 s
# regress (carry `.ort`): next11.sh regress at this tree (fold_weights runs on every model: only Gemma's graph folds
#     anything among the suite's HF families, so the e2e times should not move)
# opt: next11.sh opt at this tree (cold and warm optimize against reduce-overhead, BERT / ResNet-50 / Llama 1.1B)
set -u
. bench/steps.sh; steps_start /tmp/next20/setup "${2:-570}"
tar czf $OUT/setup.tgz -C $O .
for lane in ${1//,/ }; do
O=/tmp/next20/$lane; mkdir -p $O
case $lane in
bgreq) for o in background now; do
        step 0 bert-$o 200 env $(fresh) ACCELC_OTHER_SHAPES=$o python bench/first_requests.py --model bert --then-wait \
            --requests 40 --out $O/bert-$o
    done ;;
gemma) for i in 1 2; do
        step 0 new-$i 140 env $(fresh) python bench/generate.py --models gemma-2b --batches 1 --sides accelc \
            --out $O/new-$i
        step 0 base-$i 140 env $(fresh) PYTHONPATH=$PWD/base python bench/generate.py --models gemma-2b --batches 1 \
            --sides accelc --out $O/base-$i
    done ;;
tables) for m in qwen2-1.5b-lm-b1 gemma-2b-lm-b1; do
        step 0 races-$m 270 python bench/tuning_table.py collect --models $m --out $O/races
    done ;;
tables4) for round in "qwen2-1.5b gemma-2b phi3-mini llama3.2-1b" "llama3.2-3b qwen2.5-3b"; do
        g=0
        for m in $round; do
            ( step $g races-$m 270 python bench/tuning_table.py collect --models $m-lm-b1 --out $O/races ) &
            g=$((g + 1))
        done
        wait
    done ;;
cold15) step 0 cold15 540 python bench/optimize_time.py --models qwen2-1.5b-lm-b1,gemma-2b-lm-b1 \
        --sides compile_ro,accelc_cold --out $O/cold15 ;;
prof15) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/py_spy*.whl > $O/whl.log 2>&1
    PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"
    W=$(mktemp -d)
    step 0 cold-qwen2-1.5b 240 env ACCELC_CACHE_DIR=$W/accelc TRITON_CACHE_DIR=$W/triton TORCHINDUCTOR_CACHE_DIR=$W/inductor \
        "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/cold-qwen2-1.5b.txt \
        -- python bench/optimize_time.py --side accelc_cold --model qwen2-1.5b-lm-b1 --workdir $W
    gzip -f $O/cold-qwen2-1.5b.txt ;;
regress) sides=compile_ro,accelc
    [ -f .ort/install.sh ] && source .ort/install.sh > $O/ort-install.log 2>&1 && sides=compile_ro,ort_opt,accelc
    step 0 e2e 540 python bench/e2e.py --models bert,resnet50,llama --sides $sides --batches first --out $O/e2e ;;
opt) for m in bert resnet50 llama; do
        step 0 opt-$m 185 python bench/optimize_time.py --models $m --sides compile_ro,accelc_cold,accelc_warm \
            --out $O/opt
    done ;;
*) echo "no lane $lane" > $O/error.log ;;
esac
tar czf $OUT/$lane.tgz -C $O .
done
