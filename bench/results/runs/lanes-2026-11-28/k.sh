#!/usr/bin/env bash
# H200, 15:03-15:09 UTC (05d6eb8): a tensor-parallel rank's projections alone; the fp8 race's tl and Gluon candidates
# forced; the fp8 tests (cut at 200 s)
O=/tmp/r5; mkdir -p $O; python -m pip install --no-deps --no-build-isolation -q -e . >$O/install.log 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8; nvidia-smi -L > $O/gpus.txt
timeout 200 python bench/decode.py --rows Llama-3 --out $O/decode > $O/decode.log 2>&1; echo rc=$? >> $O/decode.log
timeout 150 python bench/attention.py --only random --out $O/att > $O/att.log 2>&1; echo rc=$? >> $O/att.log
ACCELC_AUTOTUNE=0 timeout 200 python -m pytest -p no:cacheprovider -n 4 -q --tb=long tests/test_fp8.py > $O/fp8tests.log 2>&1; echo rc=$? >> $O/fp8tests.log
tar czf $OUT/r5.tgz -C $O .
