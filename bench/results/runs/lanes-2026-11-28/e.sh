#!/usr/bin/env bash
# The triton 3.6 check of c5af8fb (the Hopper GEMM / conv first compile) and the nine-model regression check, on an
# H200 x 2 host: GPU 0 the Hopper GPU tests (cut at 150 s), then its lane of models; GPU 1 its lane from the start,
# each lane on half the cores. Everything packed into $OUT/e.tgz (the device brings back at most 8 files).
set -u
O=/tmp/e; mkdir -p $O/e2e
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
export PYTHONUNBUFFERED=1 LANES_CORES=$(( $(nproc) / 2 ))
E2E="bench/e2e.py --sides eager,compile_ro,accelc --batches first"
( CUDA_VISIBLE_DEVICES=0 ACCELC_AUTOTUNE=0 timeout 150 taskset -c 0-$(( LANES_CORES - 1 )) python -m pytest -v -n 4 \
    -p no:cacheprovider tests/test_gemm_hopper.py tests/test_conv_hopper.py tests/test_attention_hopper.py \
    > $O/pytest.log 2>&1; echo "rc=$?" >> $O/pytest.log
  LANES_GPU0=0 bash bench/lanes.sh $O/e2e 200 "$E2E" resnet50,bert,gpt2,mobilenetv2 ) &
LANES_GPU0=1 bash bench/lanes.sh $O/e2e 200 "$E2E" llama,whisper_base,vit_base,convnext_tiny,regnety_016 &
wait
tar czf $OUT/e.tgz -C $O .
