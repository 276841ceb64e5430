#!/usr/bin/env bash
# The session's third device command (two GPUs: the 4-GPU hosts were no longer lent): the TinyLlama LM's cold optimize that aborted in LLVM (a.sh/b.sh's lane 3), again
# with Python's faulthandler and accelc's log; the 8B shape's one-byte weights with and without the norm taken into
# their GEMVs; a sampling profile (py-spy, every thread, idle included) of BERT's cold optimize.
set -u
O=/tmp/res; mkdir -p $O/g0 $O/g1 $O/g2 $O/g3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $O/whl.log 2>&1
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"; echo "py-spy: $PYSPY" >> $O/whl.log
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
cold() { local d=$(mktemp -d); echo "ACCELC_CACHE_DIR=$d/accelc TRITON_CACHE_DIR=$d/triton TORCHINDUCTOR_CACHE_DIR=$d/inductor"; }
(export CUDA_VISIBLE_DEVICES=0; mkdir -p /tmp/w0 /tmp/w3
 env $(cold) timeout 330 python -X faulthandler -c "
import logging, sys, runpy
logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s %(message)s')
sys.argv = ['bench/optimize_time.py', '--side', 'accelc_cold', '--model', 'tinyllama-lm', '--workdir', '/tmp/w0']
runpy.run_path('bench/optimize_time.py', run_name='__main__')" > $O/g0/out.txt 2> $O/g0/err.txt; echo "rc=$?" >> $O/g0/err.txt
 env $(cold) timeout 230 "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/g3/bert-cold.txt -- python bench/optimize_time.py --side accelc_cold --model bert --workdir /tmp/w3 > $O/g3/out.txt 2> $O/g3/err.txt; echo "rc=$?" >> $O/g3/err.txt) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 290 python bench/generate.py --models llama3-8b --batches 1 --sides accelc_fp8w,accelc_fp8w_norms_apart --out $O/g1 > $O/g1/log.txt 2>&1; echo "rc=$?" >> $O/g1/log.txt
 timeout 270 python bench/generate.py --models llama3-8b --batches 1 --sides accelc_int8w,accelc_int8w_norms_apart --out $O/g2 > $O/g2/log.txt 2>&1; echo "rc=$?" >> $O/g2/log.txt) &
wait
tar czf $OUT/c.tgz -C $O .
