#!/usr/bin/env bash
# The session of 11:54's third device command (H200 x 2): the one-shot all-reduces (fp16 by accelc's Triton kernel
# after PyTorch 2.11's refused fp16 in h.sh) tested on two GPUs and raced against NCCL's in the sharded 8B shape's
# decode (one run); fp8 attention after its V loads were pipelined: timing and GPU tests. Packed into $OUT/i.tgz.
set -u
O=/tmp/i; mkdir -p $O
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
end=$(( $(date +%s) + ${1:-560} - 20 ))
left() { local l=$(( end - $(date +%s) )); [ $l -gt 5 ] && echo $l || echo 5; }
step() { local gpu=$1 name=$2 cap=$3; shift 3; local t=$(left); [ $t -gt $cap ] && t=$cap
  ( export CUDA_VISIBLE_DEVICES=$gpu; timeout $t "$@" > $O/$name.log 2>&1; echo "rc=$? $(date -u +%T)" >> $O/$name.log ); }
step 0,1 symm-test 60 python -m pytest -v -p no:cacheprovider -n 0 tests/test_tensor_parallel.py -k symmetric
step 0 attention 100 python bench/attention.py --only random --out $O/attention &
step 1 fp8-tests 100 env ACCELC_AUTOTUNE=0 python -m pytest -v -p no:cacheprovider -n 4 tests/test_fp8.py -k attention &
wait
step 0,1 tp8b 420 torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --sides accelc,accelc_nccl --rounds 2 --out $O/tp8b
tar czf $OUT/i.tgz -C $O .
