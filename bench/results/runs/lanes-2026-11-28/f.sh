#!/usr/bin/env bash
# After cbbf947 (the race on tuned configs), one GPU: the race timer probe, the 8B shape's fp8 weight-only step
# with the norm in and apart, then TinyLlama's default (its step races at one row too). Packed into $OUT/f.tgz.
set -u
O=/tmp/f; mkdir -p $O
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
export PYTHONUNBUFFERED=1
end=$(( $(date +%s) + ${1:-560} - 20 ))
left() { local l=$(( end - $(date +%s) )); [ $l -gt 5 ] && echo $l || echo 5; }
step() { local name=$1; shift; timeout $(left) "$@" > $O/$name.log 2>&1; echo "rc=$?" >> $O/$name.log; }
step probe python bench/race_probe.py --out $O/probe
step gen8b python bench/generate.py --batches 1 --models llama3-8b --sides accelc_fp8w,accelc_fp8w_norms_apart --out $O/gen8b
step gensmall python bench/generate.py --batches 1 --models tinyllama --sides accelc --out $O/gensmall
tar czf $OUT/f.tgz -C $O .
