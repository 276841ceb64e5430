#!/usr/bin/env bash
# What the session of 17:43 leaves owed, as one command for an H200 x 4 host (each lane's logs under /tmp/next6/<name>,
# everything packed into $OUT/next6.tgz). Nothing to carry.
#   bash bench/results/runs/lanes-2026-11-28/next6.sh [SECONDS]       # SECONDS: the whole command's budget (570)
set -u
. bench/steps.sh; steps_start /tmp/next6 "${1:-570}"
# GPUs 0, 1: the 8B shape on two GPUs and its one-GPU base in one command (run5's 324.7 tok/s against run4's 229.2
# came from two hosts), HF's compiled path beside it (the prefill target: 1.3x reduce-overhead on the sharded model)
( step 0,1 tp8b 330 torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --sides accelc,hf_compiled --rounds 2 \
      --out $O/tp8b
  step 0 tp8b-x1 200 torchrun --nproc-per-node 1 bench/tp.py --shape llama3-8b --sides accelc --rounds 2 --out $O/tp8b ) &
# GPU 2: cold optimize after f3dbefd (the padding check's unpadded call borrows configs) and 6b411b9 (a generation
# step warms its decode call alone): the TinyLlama LM and BERT, against run12 (93.9 s / 41.7 s)
( step 2 ot 280 python bench/optimize_time.py --models tinyllama-lm,bert --sides accelc_cold --out $O/ot ) &
# GPU 3: batch-1 generation as run37 ran it (Qwen2-0.5B prepare 104.3 s, TTFT 2.82 ms, 1341.6 tok/s; TinyLlama 72.1 s,
# 3.75 ms, 1009.2): the step's prefill at the example length now on the dynamic glue, TTFT the figure to watch
( step 3 gen 280 python bench/generate.py --batches 1 --models qwen2-0.5b,tinyllama --sides accelc --out $O/gen ) &
wait
tar czf $OUT/next6.tgz -C $O .
# Then, each its own command on the H200 x 4 host:
#   torchrun --nproc-per-node 4 bench/tp.py --shape llama3-70b --init meta --sides hf_compiled --rounds 2 --out $OUT/tp70
#             (the 70B target's 1.3x over HF's static-cache compile path: run5 gave accelc 71.0 tok/s)
#   torchrun --nproc-per-node 4 bench/tp.py --shape llama3-8b --sides accelc,hf_compiled --rounds 2 --out $OUT/tp8b4
#   LANES_TAR=$OUT/e2e.tgz bash bench/lanes.sh /tmp/e2e 275 "bench/e2e.py --sides eager,compile_ro,ort,ort_opt,accelc
#             --batches first" resnet50,mobilenetv2 regnety_016,vit_base bert,gpt2 llama,whisper_base
#             (carry the ONNX Runtime CUDA provider, ../shared/tools/README.md)
