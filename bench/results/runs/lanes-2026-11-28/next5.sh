#!/usr/bin/env bash
# next4.sh's runs on an H200 x 4 host, a lane per pair or GPU (each lane's logs under /tmp/next5/<name>, everything
# packed into $OUT/next5.tgz). Carry `.whl` (accelc-78e7a48.tar.gz: the optimize-time A/B's old side, as next4.sh).
#   bash bench/results/runs/lanes-2026-11-28/next5.sh [SECONDS]       # SECONDS: the whole command's budget (570)
set -u
O=/tmp/next5; mkdir -p $O /tmp/old-src
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
tar xzf .whl/accelc-78e7a48.tar.gz -C /tmp/old-src && python -m pip install --no-deps --no-build-isolation -q \
    --target /tmp/old /tmp/old-src >> $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
. bench/steps.sh; steps_budget "${1:-570}"
# GPUs 0, 1: the one-shot kernels' two-GPU test (counted signals included), the all-reduce alone (four sides), the
# sharded 8B shape with each signalling way end to end (accelc_counted: COUNTED_SIGNALS on) and NCCL
( step 0,1 symm-test 60 python -m pytest -v -p no:cacheprovider -n 0 tests/test_tensor_parallel.py -k symmetric
  step 0,1 all-reduce 60 torchrun --nproc-per-node 2 bench/all_reduce.py --out $O/all-reduce
  step 0,1 tp8b 430 torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --sides accelc,accelc_counted,accelc_nccl \
      --rounds 2 --out $O/tp8b ) &
# GPU 2: cold optimize, this tree against 78e7a48: the TinyLlama LM, then BERT
( step 2 ot-new 150 python bench/optimize_time.py --models tinyllama-lm --sides accelc_cold --out $O/ot-new
  step 2 ot-old 150 env PYTHONPATH=/tmp/old python bench/optimize_time.py --models tinyllama-lm --sides accelc_cold \
      --out $O/ot-old
  step 2 ot-bert-new 90 python bench/optimize_time.py --models bert --sides accelc_cold --out $O/ot-bert-new
  step 2 ot-bert-old 90 env PYTHONPATH=/tmp/old python bench/optimize_time.py --models bert --sides accelc_cold \
      --out $O/ot-bert-old ) &
# GPU 3: batch-1 generation after 92c05ab / e3bbe87 (run36: Qwen2-0.5B 164.7 s cold, 1341.1 tok/s), the fp8 budget
# test (591cc65), fp8 attention with its quantization timed apart
( step 3 gen-b1 330 python bench/generate.py --batches 1 --models qwen2-0.5b,tinyllama --sides accelc --out $O/gen-b1
  step 3 fp8-budget 100 env ACCELC_AUTOTUNE=0 python -m pytest -q -p no:cacheprovider -n 0 --tb=short \
      tests/test_fp8.py -k cannot_be_measured
  step 3 attention 100 python bench/attention.py --only random --out $O/attention ) &
wait
tar czf $OUT/next5.tgz -C $O .
