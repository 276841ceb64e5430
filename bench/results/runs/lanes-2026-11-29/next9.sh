#!/usr/bin/env bash
# What the session of 03:45 (2026-11-29) leaves owed, as one command for an H200 x 4 host (each lane's logs under
# /tmp/next9/<name>, everything packed into $OUT/next9.tgz). Carry `.whl` (torchao's wheel) and `.ort` (ONNX
# Runtime's CUDA provider: `cp -r ../shared/tools/ort-gpu .ort`; the tree is 13 MiB since bench/shelf.py pack).
#   bash bench/results/runs/lanes-2026-11-29/next9.sh [SECONDS]       # SECONDS: the whole command's budget (570)
set -u
. bench/steps.sh; steps_start /tmp/next9 "${1:-570}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $O/whl.log 2>&1
[ -f .ort/install.sh ] && source .ort/install.sh > $O/ort-install.log 2>&1
# GPU 0: the e2e regression check with ONNX Runtime at its best beside reduce-overhead (run47 could not carry .ort)
( step 0 e2e 540 python bench/e2e.py --models bert,resnet50,llama --sides compile_ro,ort_opt,accelc --batches first \
      --out $O/e2e ) &
# GPU 1: torchao's float8 on the Llama prefill shape, the whole lane (its max-autotune compile ran past 7.7 minutes
# in fp8/run5 beside accelc's two sides; accelc_fp8 beside it for the same-run ratio, and torchao under
# reduce-overhead first, without GEMM autotuning, so that a figure comes whatever max-autotune does)
( step 1 torchao-llama 540 env PYTHONPATH=/tmp/site python bench/e2e.py --models llama \
      --sides accelc_fp8,torchao_fp8_ro,torchao_fp8 --batches first --out $O/fp8-llama ) &
# GPU 2: the same for ViT-B
( step 2 torchao-vit 540 env PYTHONPATH=/tmp/site python bench/e2e.py --models vit_base \
      --sides accelc_fp8,torchao_fp8_ro,torchao_fp8 --batches first --out $O/fp8-vit ) &
# GPU 3: the 8B shape's one-GPU HF compiled path and accelc (run6's 2-GPU HF side 93.8 tok/s: its 1-GPU base)
( step 3 tp8b-x1 540 torchrun --nproc-per-node 1 bench/tp.py --shape llama3-8b --sides hf_compiled,accelc --rounds 3 \
      --no-profile --out $O/tp8b-x1 ) &
wait
tar czf $OUT/next9.tgz -C $O .
# Then, each its own command on the H200 x 4 host:
#   torchrun --nproc-per-node 4 bench/tp.py --shape llama3-70b --init meta --sides hf_compiled --rounds 2 \
#             --prefill '' --no-profile --out $OUT/tp70        (the 70B target's 1.3x; run5 gave accelc 71.0 tok/s)
#   torchrun --nproc-per-node 4 bench/tp.py --shape llama3-8b --sides hf_compiled,accelc --rounds 3 --out $OUT/tp8b4
#             (the prefill target on 4 GPUs; the first side's TTFT with the lower median: bench/generate.py)
