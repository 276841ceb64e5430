#!/usr/bin/env bash
# One lane of models per GPU of a multi-GPU host, each model in its own process on its lane's GPU, bound
# to its share of the CPU cores; a lane's models one after another. Progress lines into OUT/progress.txt.
#
#   bench/lanes.sh OUT SECONDS "bench/e2e.py --sides eager,compile_ro,accelc --batches first" llama resnet50,mobilenetv2 ...
#
# SECONDS: each model's time limit (a model cut by it keeps the sides it finished: e2e.py writes its JSON after
# every side). One lane argument per GPU (comma-separated models); the command gets --models M --out OUT.
# LANES_TAR=FILE: OUT packed into FILE at the end (the device brings back at most 8 files from $OUT: a lane
# per GPU writes more; OUT then lies outside $OUT, FILE inside it).
# LANES_GPU0=G: the lanes take GPUs G, G+1, ... (another command holds the ones before); LANES_CORES=C: cores a lane.
set -u
out=$1; limit=$2; cmd=$3; shift 3
mkdir -p "$out"
lanes=$#
cores=$(nproc)
per=${LANES_CORES:-$(( cores / lanes ))}
g0=${LANES_GPU0:-0}
i=0
for lane in "$@"; do
  (
    gpu=$(( g0 + i )); lo=$(( gpu * per )); hi=$(( lo + per - 1 ))
    for m in ${lane//,/ }; do
      echo "lane$i (GPU $gpu): $(date -u +%H:%M:%S) start $m" >> "$out/progress.txt"
      CUDA_VISIBLE_DEVICES=$gpu TORCHINDUCTOR_COMPILE_THREADS=$per timeout "$limit" \
        taskset -c "$lo-$hi" python $cmd --models "$m" --out "$out" > "$out/log-$m.txt" 2>&1
      echo "lane$i (GPU $gpu): $(date -u +%H:%M:%S) done $m (rc $?)" >> "$out/progress.txt"
    done
  ) &
  i=$(( i + 1 ))
done
wait
if [ -n "${LANES_TAR:-}" ]; then
  tar czf "$LANES_TAR" -C "$out" .
fi
