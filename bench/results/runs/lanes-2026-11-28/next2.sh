#!/usr/bin/env bash
# The runs the session of 09:05 owes, as one command for the next device call (lanes over 1, 2 or 4 GPUs; each
# lane's results under /tmp/next2/<lane>, everything packed into $OUT/next2.tgz: the device brings back 8 files).
#   bash bench/results/runs/lanes-2026-11-28/next2.sh [SECONDS]       # SECONDS: the whole command's budget (560)
# Carry `.whl` (torchao's wheel) for the fp8 peers. The 4-GPU tensor-parallel run is its own command (see the end).
set -u
budget=${1:-560}
O=/tmp/next2; mkdir -p $O
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
n=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$n" -ge 1 ] || n=1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / n ))
end=$(( $(date +%s) + budget - 25 ))
left() { local l=$(( end - $(date +%s) )); [ $l -gt 5 ] && echo $l || echo 5; }
step() { local gpu=$1 name=$2; shift 2
  ( export CUDA_VISIBLE_DEVICES=$gpu; timeout $(left) "$@" > $O/$name.log 2>&1; echo "rc=$?" >> $O/$name.log ); }
# 1. the small models' decode after cbbf947 (the step's race on tuned configs): run34's next-small is before it
lane0() { step 0 gensmall python bench/generate.py --batches 1 --models tinyllama,qwen2-0.5b \
            --sides accelc,accelc_norms_apart --out $O/gensmall
          step 0 probe python bench/race_probe.py --shapes 2048x2048,2048x11264,5632x2048 --out $O/probe
          # fp8 attention's first GPU run (cd46828): its rows beside the fp16 kernel and SDPA
          step 0 attention python bench/attention.py --only random,vit,bert --out $O/attention; }
# 2. the 8B shape's fp16 and fp8 weights in one process after it (one A/B; run34's fp16 side is before it), and the
#    fp8 weights with every norm apart: eaa169e takes the gate/up norm in for one-byte weights (the rule's A/B)
lane1() { step $(( 1 % n )) gen8b python bench/generate.py --batches 1 --models llama3-8b \
            --sides accelc,accelc_fp8w,accelc_fp8w_norms_apart --out $O/gen8b; }
# 3. the attention's Hopper GPU tests (e.sh ran 36 of 137), then the fp8 peers where torchao's wheel came
lane2() { step $(( 2 % n )) pytest env ACCELC_AUTOTUNE=0 python -m pytest -v -n 4 -p no:cacheprovider \
            tests/test_attention_hopper.py tests/test_norm_linear.py tests/test_fp8.py
          ls .whl/torchao-*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-deps --target /tmp/tao .whl/torchao-*.whl \
            && step $(( 2 % n )) fp8peer env PYTHONPATH=/tmp/tao python bench/e2e.py --models vit_base,bert,llama \
                 --sides accelc,accelc_fp8,torchao_fp8 --batches first --out $O/fp8peer; }
# 4. optimize time with the warm sides (run11 cut them)
lane3() { step $(( 3 % n )) opt python bench/optimize_time.py --models bert,tinyllama-lm \
            --sides compile_ro,accelc_cold,accelc_warm --out $O/opt
          step $(( 3 % n )) gen8b-int8w python bench/generate.py --batches 1 --models llama3-8b \
            --sides accelc_int8w,accelc_int8w_norms_apart --out $O/gen8b-int8w; }
if [ "$n" -ge 4 ]; then lane0 & lane1 & lane2 & lane3 & wait
elif [ "$n" -ge 2 ]; then (lane0; lane2) & (lane1; lane3) & wait
else lane0; lane1; lane2; lane3
fi
tar czf $OUT/next2.tgz -C $O .
# The tensor-parallel runs (#59), each its own command on a host of that many GPUs:
#   torchrun --nproc-per-node 4 bench/tp.py --shape llama3-70b --init meta --out $OUT/tp70b
#   torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --plan hf --out $OUT/tp8b-hf
