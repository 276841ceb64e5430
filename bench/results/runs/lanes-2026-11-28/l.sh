#!/usr/bin/env bash
# H200, 15:11-15:16 UTC (05d6eb8): the fp8 output-budget tests alone (cut at 150 s, none finished); the 8B shape's
# decode step kernel by kernel with programmatic dependent launch off (each kernel's own time)
O=/tmp/r6; mkdir -p $O; python -m pip install --no-deps --no-build-isolation -q -e . >$O/install.log 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
ACCELC_AUTOTUNE=0 timeout 150 python -m pytest -p no:cacheprovider -n 0 -q --tb=long -x tests/test_fp8.py -k "cannot_be_measured or sends_the_lowest or judged_by_sqnr" --durations=5 > $O/fp8tests.log 2>&1; echo rc=$? >> $O/fp8tests.log
ACCELC_PDL=0 timeout 150 python bench/decode.py --profile --model llama3-8b --layers 4 --out $O/prof > $O/prof.log 2>&1; echo rc=$? >> $O/prof.log
tar czf $OUT/r6.tgz -C $O .
