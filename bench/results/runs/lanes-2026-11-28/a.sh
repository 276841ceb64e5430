#!/usr/bin/env bash
# Four lanes, one a GPU of a 4-GPU host (the session's first device command).
set -u
O=$OUT
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt
python -c "import triton, triton.experimental.gluon.language as gl, triton.language.core as c; print(triton.__version__, [n for n in dir(gl) if 'aggr' in n.lower()], [n for n in dir(c) if 'aggr' in n.lower()])" > $O/gluon_aggregate_probe.txt 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
mkdir -p $O/g0 $O/g1 $O/g2 $O/g3
(export CUDA_VISIBLE_DEVICES=0
 ACCELC_AUTOTUNE=0 timeout 280 python -m pytest -x -v -n 4 -p no:cacheprovider tests/test_fp8.py tests/test_norm_linear.py tests/test_gemm_hopper.py > $O/g0/pytest.txt 2>&1; echo "rc=$?" >> $O/g0/pytest.txt
 timeout 270 python bench/e2e.py --models llama --sides accelc,accelc_fp8 --batches first --out $O/g0/e2e > $O/g0/e2e.log 2>&1; echo "rc=$?" >> $O/g0/e2e.log) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 560 python bench/generate.py --models tinyllama --batches 1 --sides accelc,accelc_norms_apart,accelc_fp8w --out $O/g1 > $O/g1/log.txt 2>&1; echo "rc=$?" >> $O/g1/log.txt) &
(export CUDA_VISIBLE_DEVICES=2
 timeout 560 python bench/generate.py --models llama3-8b --batches 1 --sides accelc,accelc_fp8w --out $O/g2 > $O/g2/log.txt 2>&1; echo "rc=$?" >> $O/g2/log.txt) &
(export CUDA_VISIBLE_DEVICES=3
 timeout 300 python bench/optimize_time.py --models bert,tinyllama-lm --sides accelc_cold --profile --out $O/g3/opt > $O/g3/opt.log 2>&1; echo "rc=$?" >> $O/g3/opt.log
 timeout 250 python bench/generate.py --models qwen2-0.5b --batches 1 --sides accelc,accelc_norms_apart --out $O/g3/gen > $O/g3/gen.log 2>&1; echo "rc=$?" >> $O/g3/gen.log) &
wait
