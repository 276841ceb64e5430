#!/usr/bin/env bash
# What the session of 14:47 leaves owed, as one command for an H200 x 2 host (each lane's results under /tmp/next4/<name>,
# everything packed into $OUT/next4.tgz). Carry `.whl`: torchao's wheel and accelc-78e7a48.tar.gz (the tree before this
# session's library changes, `git archive 78e7a48 -- pyproject.toml README.md accelc passes kernels models`), the A/B's
# old side, installed with --target and put first by PYTHONPATH (each row names the accelc it imported).
#   bash bench/results/runs/lanes-2026-11-28/next4.sh [SECONDS]       # SECONDS: the whole command's budget (560)
set -u
O=/tmp/next4; mkdir -p $O /tmp/old-src
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
tar xzf .whl/accelc-78e7a48.tar.gz -C /tmp/old-src && python -m pip install --no-deps --no-build-isolation -q \
    --target /tmp/old /tmp/old-src >> $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
. bench/steps.sh; steps_budget "${1:-560}"
# 1. both GPUs: the one-shot kernels' two-GPU test (6e8418f: accelc's kernel up to 64 KB, signalling by exchange by
#    default; 5068bb8: counted signals, off by default, run by the test and timed as bench/all_reduce.py's fourth
#    side: where they win, flip COUNTED_SIGNALS and run tp8b again), the all-reduce alone, then the sharded 8B shape
step 0,1 symm-test 60 python -m pytest -v -p no:cacheprovider -n 0 tests/test_tensor_parallel.py -k symmetric
step 0,1 all-reduce 60 torchrun --nproc-per-node 2 bench/all_reduce.py --out $O/all-reduce
step 0,1 tp8b 260 torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --sides accelc,accelc_nccl --out $O/tp8b
# 2. cold optimize, this tree against 78e7a48 (92c05ab: a causal LM's forward leaves its glue for other shapes to a
#    first call; e3bbe87: one timing for twin layers): GPU 0 the TinyLlama LM, GPU 1 BERT, each side cold
( step 0 ot-new 150 python bench/optimize_time.py --models tinyllama-lm --sides accelc_cold --out $O/ot-new
  step 0 ot-old 150 env PYTHONPATH=/tmp/old python bench/optimize_time.py --models tinyllama-lm --sides accelc_cold \
      --out $O/ot-old ) &
( step 1 ot-bert-new 90 python bench/optimize_time.py --models bert --sides accelc_cold --out $O/ot-bert-new
  step 1 ot-bert-old 90 env PYTHONPATH=/tmp/old python bench/optimize_time.py --models bert --sides accelc_cold \
      --out $O/ot-bert-old
  step 1 fp8-budget 100 env ACCELC_AUTOTUNE=0 python -m pytest -q -p no:cacheprovider -n 0 --tb=short \
      tests/test_fp8.py -k cannot_be_measured
  step 1 attention 100 python bench/attention.py --only random --out $O/attention ) &   # fp8: its quantization apart
wait
tar czf $OUT/next4.tgz -C $O .
# Then, each its own command:
#   H200 x 2: bench/generate.py --batches 1 --models qwen2-0.5b,tinyllama --sides accelc (prepare and decode after
#             92c05ab / e3bbe87: run36's Qwen2-0.5B 164.7 s cold, 1341.1 tok/s); the 8B shape accelc,accelc_fp8w,accelc_int8w
#   H200 (one lane each): python bench/tuning_table.py collect --models qwen2-0.5b-lm-b1,tinyllama-lm-b1 --out $OUT/tt-b1
#             (the batch-1 generations' races: the shipped table has no one-row decode key), then on the CPU
#             python bench/tuning_table.py build bench/results/runs/tuning_table/run1-h200 <its folder>
#   H200 x 4: LANES_TAR=$OUT/e2e.tgz bash bench/lanes.sh /tmp/e2e 275 "bench/e2e.py --sides eager,compile_ro,ort,ort_opt,accelc
#             --batches first" resnet50,mobilenetv2,convnext_tiny regnety_016,vit_base bert,gpt2 llama,whisper_base
#             (carry the ONNX Runtime CUDA provider, ../shared/tools/README.md)
#   H200 x 4: torchrun --nproc-per-node 4 bench/tp.py --shape llama3-70b --init meta --out $OUT/tp70b
