#!/usr/bin/env bash
# The runs the session of 11:54 owes, as one command for an H200 x 2 host (the kind lent; each lane's results under
# /tmp/next3/<name>, everything packed into $OUT/next3.tgz: the device brings back 8 files).
#   bash bench/results/runs/lanes-2026-11-28/next3.sh [SECONDS]       # SECONDS: the whole command's budget (560)
# Carry `.whl` (torchao's wheel) for the fp8 peer. The 4-GPU runs (the nine models with every peer, the 70B shape)
# are their own commands (the end).
set -u
O=/tmp/next3; mkdir -p $O
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
end=$(( $(date +%s) + ${1:-560} - 20 ))
left() { local l=$(( end - $(date +%s) )); [ $l -gt 5 ] && echo $l || echo 5; }
step() { local gpu=$1 name=$2 cap=$3; shift 3; local t=$(left); [ $t -gt $cap ] && t=$cap
  ( export CUDA_VISIBLE_DEVICES=$gpu; timeout $t "$@" > $O/$name.log 2>&1; echo "rc=$? $(date -u +%T)" >> $O/$name.log ); }
# 1. both GPUs: the two-GPU test of the one-shot kernels (d9cb687: the barriers on flag sets of their own, senders by
#    compare-and-swap and by exchange), then the all-reduce alone (NCCL vs the one-shot kernels, both ways)
step 0,1 symm-test 60 python -m pytest -v -p no:cacheprovider -n 0 tests/test_tensor_parallel.py -k symmetric
step 0,1 all-reduce 60 torchrun --nproc-per-node 2 bench/all_reduce.py --out $O/all-reduce
# 2. GPU 0: the fp8 Gluon attention's first GPU tests (c5d48a1), then its timing beside the tl fp8 and fp16 kernels;
#    GPU 1: Qwen2-0.5B's decode and TinyLlama's norms-apart side (run35 cut them)
( step 0 gluon-fp8-tests 150 env ACCELC_AUTOTUNE=0 python -m pytest -v -p no:cacheprovider -n 4 \
    tests/test_attention_hopper.py -k "fp8" tests/test_fp8.py
  step 0 attention 120 python bench/attention.py --only random,vit,bert --out $O/attention ) &
step 1 gensmall 280 python bench/generate.py --batches 1 --models qwen2-0.5b,tinyllama --sides accelc,accelc_norms_apart \
    --out $O/gensmall &
wait
tar czf $OUT/next3.tgz -C $O .
# Then, each its own command:
#   H200 x 2: torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --sides accelc,accelc_nccl --rounds 2, and
#             --nproc-per-node 1 --sides accelc on GPU 0 after it (the scaling's base in one command)
#   H200 x 2: the 8B shape `accelc,accelc_fp8w,accelc_int8w` (bench/generate.py --batches 1 --models llama3-8b), one process
#   H200 x 4: LANES_TAR=$OUT/e2e.tgz bash bench/lanes.sh /tmp/e2e 275 "bench/e2e.py --sides eager,compile_ro,ort,ort_opt,accelc
#             --batches first" resnet50,mobilenetv2,convnext_tiny regnety_016,vit_base bert,gpt2 llama,whisper_base
#             (carry the ONNX Runtime CUDA provider, ../shared/tools/README.md)
#   H200 x 4: torchrun --nproc-per-node 4 bench/tp.py --shape llama3-70b --init meta --out $OUT/tp70b
