#!/usr/bin/env bash
# One H200: a sampling profile (py-spy, every thread, idle included) of the TinyLlama LM's cold optimize, the forward
# and the generation step, to see where its 94 s go (optimize_time/run12-h200-ab). Carry `.whl` (py-spy's wheel).
set -u
O=/tmp/m; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/py_spy*.whl > $O/whl.log 2>&1
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
PYSPY=$(find /tmp/site -name py-spy -type f | head -1); chmod +x "$PYSPY"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
d=$(mktemp -d)
env ACCELC_CACHE_DIR=$d/accelc TRITON_CACHE_DIR=$d/triton TORCHINDUCTOR_CACHE_DIR=$d/inductor timeout ${1:-200} \
    "$PYSPY" record --idle --threads --nonblocking --rate 40 -f raw -o $O/tinyllama-lm-cold.txt -- \
    python bench/optimize_time.py --side accelc_cold --model tinyllama-lm --workdir /tmp/w > $O/out.txt 2> $O/err.txt
echo "rc=$?" >> $O/err.txt
gzip $O/tinyllama-lm-cold.txt; tar czf $OUT/m.tgz -C $O .
