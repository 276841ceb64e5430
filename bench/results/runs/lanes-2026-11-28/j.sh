#!/usr/bin/env bash
# H200 x 2, 14:53-15:01 UTC (78e7a48): the sharded 8B shape, one-shot all-reduces against NCCL, then its one-GPU base
O=/tmp/r4; mkdir -p $O; python -m pip install --no-deps --no-build-isolation -q -e . >$O/install.log 2>&1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
timeout 300 torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b --sides accelc,accelc_nccl --rounds 2 --out $O/tp2 > $O/tp2.log 2>&1; echo rc=$? >> $O/tp2.log
CUDA_VISIBLE_DEVICES=0 timeout 220 torchrun --nproc-per-node 1 bench/tp.py --shape llama3-8b --sides accelc --out $O/tp1 > $O/tp1.log 2>&1; echo rc=$? >> $O/tp1.log
tar czf $OUT/r4.tgz -C $O .
