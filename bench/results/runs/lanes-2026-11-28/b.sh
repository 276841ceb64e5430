#!/usr/bin/env bash
# The lanes whose files a.sh's fetch left out, again (results tarred into one file).
set -u
O=/tmp/res; mkdir -p $O/g0 $O/g1 $O/g2 $O/g3
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
(export CUDA_VISIBLE_DEVICES=0
 ACCELC_AUTOTUNE=0 timeout 300 python -m pytest -x -v -n 4 -p no:cacheprovider tests/test_norm_linear.py > $O/g0/pytest.txt 2>&1; echo "rc=$?" >> $O/g0/pytest.txt) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 500 python bench/generate.py --models llama3-8b --batches 1 --sides accelc_int8w --out $O/g1 > $O/g1/log.txt 2>&1; echo "rc=$?" >> $O/g1/log.txt) &
(export CUDA_VISIBLE_DEVICES=2
 timeout 540 python bench/generate.py --models llama3-8b --batches 1 --sides accelc,accelc_fp8w --out $O/g2 > $O/g2/log.txt 2>&1; echo "rc=$?" >> $O/g2/log.txt) &
(export CUDA_VISIBLE_DEVICES=3
 timeout 300 python bench/optimize_time.py --models bert,tinyllama-lm --sides accelc_cold --profile --out $O/g3/opt > $O/g3/opt.log 2>&1; echo "rc=$?" >> $O/g3/opt.log
 timeout 230 python bench/generate.py --models qwen2-0.5b --batches 1 --sides accelc,accelc_norms_apart --out $O/g3/gen > $O/g3/gen.log 2>&1; echo "rc=$?" >> $O/g3/gen.log) &
wait
tar czf $OUT/b.tgz -C $O .
