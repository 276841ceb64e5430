#!/usr/bin/env bash
# The session of 08:33 (2026-11-29), one-GPU H200, after next11.sh's `opt` lane cut its Llama warm side at the step's
# cap: #56's warm figure for the Llama 1.1B e2e shape, then the Llama-3-8B shape's generation optimize (the issue's
# "60 s cold, 10 s warm"), never measured before; then (lane kept) BERT and the Llama 1.1B shape cold and warm after
# a74c48b (the captured graph kept across processes). Logs under /tmp/next12/<lane> (kept: $OUT/kept, as they come),
# packed into $OUT/<lane>.tgz.
#   bash bench/results/runs/lanes-2026-11-29/next12.sh LANE [SECONDS]     # SECONDS: the command's budget (570)
set -u
lane=$1
dir=/tmp/next12/$lane; [ $lane = kept ] && dir=$OUT/kept
. bench/steps.sh; steps_start $dir "${2:-570}"
case $lane in
warm8b) step 0 opt-llama 200 python bench/optimize_time.py --models llama --sides accelc_cold,accelc_warm --out $O/opt
     step 0 opt-llama3-8b-lm 560 python bench/optimize_time.py --models llama3-8b-lm --sides accelc_cold,accelc_warm \
         --out $O/opt ;;
kept) step 0 opt-bert 110 python bench/optimize_time.py --models bert --sides accelc_cold,accelc_warm --out $O/opt
     step 0 opt-llama 200 python bench/optimize_time.py --models llama --sides accelc_cold,accelc_warm --out $O/opt ;;
esac
[ $lane = kept ] && exit 0
tar czf $OUT/$lane.tgz -C $O .
