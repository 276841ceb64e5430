#!/usr/bin/env bash
# What the session of 20:21 leaves owed, as one command for an H200 x 4 host (each lane's logs under /tmp/next7/<name>,
# everything packed into $OUT/next7.tgz). Carry `.whl` (py-spy's and torchao's wheels) and `.ort` (ONNX Runtime's
# CUDA provider: `cp -r ../shared/tools/ort-gpu .ort`, 45 MB).
#   bash bench/results/runs/lanes-2026-11-28/next7.sh [SECONDS]       # SECONDS: the whole command's budget (570)
set -u
. bench/steps.sh; steps_start /tmp/next7 "${1:-570}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $O/whl.log 2>&1
PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"
C=$(mktemp -d)     # empty caches for a cold run (`step ... env $COLD cmd`: a shell function would not pass `timeout`)
COLD="ACCELC_CACHE_DIR=$C/accelc TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor"
# GPU 0: the regression check after be7845b..cb57165 (optimize's stages, the greedy loop's steps, the linear launch
# plan): three e2e models against reduce-overhead and ONNX Runtime at its best, as run46 ran them
[ -f .ort/install.sh ] && source .ort/install.sh > $O/ort-install.log 2>&1
( step 0 e2e 540 python bench/e2e.py --models bert,resnet50,llama --sides compile_ro,ort_opt,accelc --batches first \
      --out $O/e2e ) &
# GPU 1: where Qwen2-0.5B's batch-1 prepare goes (104-120 s; its step's guard 36-43 s with the shipped table's keys
# for every projection: not the races), py-spy over a cold bench/generate.py
( step 1 qwen-pyspy 330 env $COLD "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/qwen2-b1-cold.txt -- \
      python bench/generate.py --batches 1 --models qwen2-0.5b --sides accelc --out $O/qwen ; gzip -f $O/qwen2-b1-cold.txt ) &
# GPU 2: torchao's float8 beside accelc's fp8 (#61's peer, never run): the Llama prefill shape and ViT-B
( step 2 fp8 540 env PYTHONPATH=/tmp/site python bench/e2e.py --models llama,vit_base \
      --sides accelc,accelc_fp8,torchao_fp8 --batches first --out $O/fp8 ) &
# GPU 3: the 8B shape's one-GPU HF compiled path and accelc (run6's 2-GPU HF side 93.8 tok/s: its 1-GPU base)
( step 3 tp8b-x1 400 torchrun --nproc-per-node 1 bench/tp.py --shape llama3-8b --sides hf_compiled,accelc --rounds 2 \
      --no-profile --out $O/tp8b-x1
  step 3 tinyllama-profile 150 torchrun --nproc-per-node 1 bench/tp.py --shape tinyllama --sides accelc --rounds 2 \
      --prefill '' --out $O/tinyllama ) &     # (#60: TinyLlama's decode step by kernel, batch 1, at 50% of the limit)
wait
tar czf $OUT/next7.tgz -C $O .
# Then, each its own command on the H200 x 4 host:
#   torchrun --nproc-per-node 4 bench/tp.py --shape llama3-70b --init meta --sides hf_compiled --rounds 2 \
#             --prefill '' --no-profile --out $OUT/tp70        (the 70B target's 1.3x; run5 gave accelc 71.0 tok/s)
#   torchrun --nproc-per-node 4 bench/tp.py --shape llama3-8b --sides hf_compiled,accelc --rounds 2 --out $OUT/tp8b4
#             (the prefill target on 4 GPUs; the profile: where a decode step's and a prefill's GPU time goes)
