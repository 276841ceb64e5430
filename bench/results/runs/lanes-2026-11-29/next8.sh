#!/usr/bin/env bash
# next7.sh's lanes for a one-GPU H200, one lane per device command (each under the 10-minute cap); its logs under
# /tmp/next8/<lane>, packed into $OUT/<lane>.tgz. Carry `.whl` (py-spy's and torchao's wheels) and `.ort` (ONNX
# Runtime's CUDA provider: `cp -r ../shared/tools/ort-gpu .ort`).
#   bash bench/results/runs/lanes-2026-11-29/next8.sh LANE [SECONDS]     # SECONDS: the command's budget (570)
# LANE: e2e (the regression check after be7845b..cb57165: three e2e models against reduce-overhead and ONNX Runtime
# at its best, as run46 ran them), fp8 (torchao's float8 beside accelc's fp8, #61's peer), qwen (py-spy over a cold
# Qwen2-0.5B batch-1 generate, #56), tp8b (the 8B shape's one-GPU HF compiled path and accelc, #59's base),
# tinyllama (TinyLlama's decode step by kernel, batch 1, #60)
set -u
lane=$1
. bench/steps.sh; steps_start /tmp/next8/$lane "${2:-570}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $O/whl.log 2>&1
PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"
C=$(mktemp -d)     # empty caches for a cold run (`step ... env $COLD cmd`: a shell function would not pass `timeout`)
COLD="ACCELC_CACHE_DIR=$C/accelc TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor"
case $lane in
e2e) sides=compile_ro,accelc       # ONNX Runtime's side where `.ort` travels
     [ -f .ort/install.sh ] && source .ort/install.sh > $O/ort-install.log 2>&1 && sides=compile_ro,ort_opt,accelc
     step 0 e2e 560 python bench/e2e.py --models bert,resnet50,llama --sides $sides --batches first \
         --out $O/e2e ;;
fp8) step 0 fp8 560 env PYTHONPATH=/tmp/site python bench/e2e.py --models llama,vit_base \
         --sides accelc,accelc_fp8,torchao_fp8 --batches first --out $O/fp8 ;;
qwen) step 0 qwen-pyspy 400 env $COLD "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/qwen2-b1-cold.txt \
         -- python bench/generate.py --batches 1 --models qwen2-0.5b --sides accelc --out $O/qwen
      gzip -f $O/qwen2-b1-cold.txt
      step 0 tinyllama-profile 300 torchrun --nproc-per-node 1 bench/tp.py --shape tinyllama --sides accelc --rounds 2 \
         --prefill '' --out $O/tinyllama ;;
tp8b) step 0 tp8b-x1 560 torchrun --nproc-per-node 1 bench/tp.py --shape llama3-8b --sides hf_compiled,accelc --rounds 2 \
         --no-profile --out $O/tp8b-x1 ;;
esac
tar czf $OUT/$lane.tgz -C $O .
