#!/usr/bin/env bash
# The session's last device command (two GPUs): the TinyLlama LM's cold optimize again after 21f2877 (the compiles at
# other sizes by the workers first; a compile that ends a worker refused in the process), and the RMSNorm before a
# decode projection at the 8B's and TinyLlama's shapes per weight (bench/fp8.py --norm).
set -u
O=/tmp/res; mkdir -p $O/g0 $O/g1
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
cold() { local d=$(mktemp -d); echo "ACCELC_CACHE_DIR=$d/accelc TRITON_CACHE_DIR=$d/triton TORCHINDUCTOR_CACHE_DIR=$d/inductor"; }
(export CUDA_VISIBLE_DEVICES=0; mkdir -p /tmp/w0
 env $(cold) timeout 225 python -X faulthandler -c "
import logging, sys, runpy
logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s %(message)s')
sys.argv = ['bench/optimize_time.py', '--side', 'accelc_cold', '--model', 'tinyllama-lm', '--workdir', '/tmp/w0']
runpy.run_path('bench/optimize_time.py', run_name='__main__')" > $O/g0/out.txt 2> $O/g0/err.txt; echo "rc=$?" >> $O/g0/err.txt) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 225 python bench/fp8.py --gemm '' --decode '' --norm 1x4096x6144,1x4096x28672,1x2048x2560 --out $O/g1 > $O/g1/log.txt 2>&1; echo "rc=$?" >> $O/g1/log.txt) &
wait
tar czf $OUT/d.tgz -C $O .
