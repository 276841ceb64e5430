#!/usr/bin/env bash
# The session of 11:54's second device command (H200 x 2): the one-shot all-reduce (accelc/fast_all_reduce.py)
# tested on two GPUs and raced against NCCL's in the sharded 8B shape's decode (one run), and fp8 attention after
# its operands are quantized once (kernels/attention_fp8.py): its GPU tests and first timing. Packed into $OUT/h.tgz.
set -u
O=/tmp/h; mkdir -p $O
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
end=$(( $(date +%s) + ${1:-560} - 20 ))
left() { local l=$(( end - $(date +%s) )); [ $l -gt 5 ] && echo $l || echo 5; }
step() { local gpu=$1 name=$2 cap=$3; shift 3; local t=$(left); [ $t -gt $cap ] && t=$cap
  ( export CUDA_VISIBLE_DEVICES=$gpu; timeout $t "$@" > $O/$name.log 2>&1; echo "rc=$? $(date -u +%T)" >> $O/$name.log ); }
step 0,1 symm-test 90 python -m pytest -v -p no:cacheprovider -n 0 tests/test_tensor_parallel.py -k symmetric
step 0 attention 110 python bench/attention.py --only random --out $O/attention &
step 1 fp8-tests 110 env ACCELC_AUTOTUNE=0 python -m pytest -v -p no:cacheprovider -n 4 tests/test_fp8.py -k attention &
wait
step 0,1 tp8b 400 torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --sides accelc,accelc_nccl --rounds 2 --out $O/tp8b
tar czf $OUT/h.tgz -C $O .
