#!/usr/bin/env bash
# The session of 11:54's first device command (H200 x 2): the 8B shape sharded over 2 GPUs after cbbf947 (the step's
# race on tuned configs: run1's step kept cuBLAS at the rank's shapes on borrowed configs), its one-GPU base in the
# same run, and next2.sh's first lane (small-model decode, the race probe, fp8 attention's first timing) beside it.
# Everything under /tmp/g, packed into $OUT/g.tgz.
set -u
O=/tmp/g; mkdir -p $O
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
end=$(( $(date +%s) + ${1:-560} - 25 ))
left() { local l=$(( end - $(date +%s) )); [ $l -gt 5 ] && echo $l || echo 5; }
step() { local gpu=$1 name=$2 cap=$3; shift 3; local t=$(left); [ $t -gt $cap ] && t=$cap
  ( export CUDA_VISIBLE_DEVICES=$gpu; timeout $t "$@" > $O/$name.log 2>&1; echo "rc=$? $(date -u +%T)" >> $O/$name.log ); }
# 1. both GPUs: the sharded 8B shape, accelc only (run1 has HF's compiled path: 71.1 tok/s)
step 0,1 tp8b-x2 260 torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --sides accelc --rounds 2 --out $O/tp8b-x2
# 2. GPU 0: the one-GPU base; GPU 1: the small models' decode after cbbf947, the probe, fp8 attention
step 0 tp8b-x1 260 torchrun --nproc-per-node 1 bench/tp.py --shape llama3-8b --sides accelc --rounds 2 --out $O/tp8b-x1 &
( step 1 attention 90 python bench/attention.py --only random,vit,bert --out $O/attention
  step 1 gensmall 200 python bench/generate.py --batches 1 --models tinyllama,qwen2-0.5b --sides accelc,accelc_norms_apart --out $O/gensmall ) &
wait
tar czf $OUT/g.tgz -C $O .
