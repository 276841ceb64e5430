#!/usr/bin/env bash
# The runs this session owes (its closing note's list), one command for the next device call: lanes over the host's
# GPUs (1, 2 or 4), each lane's results under /tmp/next/gN, everything packed into $OUT/next.tgz at the end (the
# device brings back at most 8 files). Each step has its own time limit; a cut step keeps what it wrote.
#   bash bench/results/runs/lanes-2026-11-28/next.sh [SECONDS]      # SECONDS: the whole command's budget (560)
set -u
budget=${1:-560}
O=/tmp/next; mkdir -p $O
python -m pip install --no-deps --no-build-isolation -q -e . > $O/install.log 2>&1
nvidia-smi -L > $O/gpus.txt 2>&1
n=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$n" -ge 1 ] || n=1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / n ))
end=$(( $(date +%s) + budget - 25 ))
left() { local l=$(( end - $(date +%s) )); [ $l -gt 5 ] && echo $l || echo 5; }
step() {   # step GPU NAME COMMAND...: on that GPU, within what is left of the budget
  local gpu=$1 name=$2; shift 2
  ( export CUDA_VISIBLE_DEVICES=$gpu; timeout $(left) "$@" > $O/$name.log 2>&1; echo "rc=$?" >> $O/$name.log )
}
lane0() {   # the triton 3.6 check of the Gluon aggregates and the new NORM loop, then the norm rows
  step 0 pytest env ACCELC_AUTOTUNE=0 python -m pytest -x -v -n 4 -p no:cacheprovider tests/test_gemm_hopper.py \
    tests/test_conv_hopper.py tests/test_attention_hopper.py tests/test_norm_linear.py tests/test_compile_workers.py
  for k in gemm conv attention; do step 0 gluon-$k env TRITON_INTERPRET=0 python bench/gluon_compile.py --kernel $k --json; done
  step 0 norm python bench/fp8.py --gemm '' --decode '' --norm 1x4096x6144,1x4096x28672,1x2048x2560 --out $O/norm
}
lane1() { step $(( 1 % n )) gen8b python bench/generate.py --batches 1 --models llama3-8b \
            --sides accelc,accelc_fp8w,accelc_fp8w_norms_apart,accelc_int8w --out $O/gen8b
          ls .whl/torchao-*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-deps --target /tmp/tao1 .whl/torchao-*.whl \
            && step $(( 1 % n )) gen8b-peer env PYTHONPATH=/tmp/tao1 python bench/generate.py --batches 1 \
                 --models llama3-8b --sides accelc_fp8w,torchao_fp8w --out $O/gen8b-peer; }
lane2() { step $(( 2 % n )) gensmall python bench/generate.py --batches 1 --models tinyllama,qwen2-0.5b \
            --sides accelc,accelc_norms_apart --out $O/gensmall
          # TinyLlama's decode step by kernel: the fused norm + q/k/v GEMV's own time there (the guard's race said
          # 20.5 us where bench/fp8.py --norm times it at 5.5)
          step $(( 2 % n )) profile python bench/decode.py --profile --model tinyllama --layers 4 --out $O/profile
          # the fp8 peer (#61): torchao's float8 where its wheel came in .whl (carry it; see bench/e2e.py)
          ls .whl/torchao-*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-deps --target /tmp/tao .whl/torchao-*.whl \
            && step $(( 2 % n )) fp8peer env PYTHONPATH=/tmp/tao python bench/e2e.py --models vit_base,bert,llama \
                 --sides accelc,accelc_fp8,torchao_fp8 --batches first --out $O/fp8peer; }
lane3() { step $(( 3 % n )) opt python bench/optimize_time.py --models bert,tinyllama-lm \
            --sides compile_ro,accelc_cold,accelc_warm --out $O/opt; }
if [ "$n" -ge 4 ]; then lane0 & lane1 & lane2 & lane3 & wait
elif [ "$n" -ge 2 ]; then (lane0; lane2) & (lane1; lane3) & wait
else lane0; lane1; lane2; lane3
fi
tar czf $OUT/next.tgz -C $O .
