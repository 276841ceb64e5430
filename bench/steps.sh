# Steps of one device command, each with its own time limit within the command's: sourced by a lanes script
# (bench/results/runs/lanes-*/), after it sets O (the folder each step's log goes to) and calls steps_budget, or
# calls steps_start, which also installs this tree and records the GPUs:
#   . bench/steps.sh; O=/tmp/x; steps_budget 560
#   . bench/steps.sh; steps_start /tmp/x 560      # O=/tmp/x, install.log and gpus.txt in it, the budget set
#   step GPUS NAME CAP COMMAND...   # COMMAND on GPUS (CUDA_VISIBLE_DEVICES), its output and exit status in
#                                   # $O/NAME.log, cut at CAP seconds or at what is left of the budget
# or runs a lanes script's lanes, its function `lane NAME` (steps in $O) called for each, after steps_start:
#   lane() { case $1 in a) step 0 a 100 python ...;; *) echo "no lane $1" > $O/error.log;; esac; }
#   lanes_run /tmp/next22 "$1" "${2:-570}"     # logs under /tmp/next22/<lane>, each packed into $OUT/<lane>.tgz
# env assignments for one process's caches, new and empty (a cold side): `env $(fresh) python ...`
fresh() { local c; c=$(mktemp -d)
  echo "ACCELC_CACHE_DIR=$c/accelc TRITON_CACHE_DIR=$c/triton TORCHINDUCTOR_CACHE_DIR=$c/inductor"; }
steps_budget() { steps_end=$(( $(date +%s) + ${1:-560} - 20 )); }      # (20 s kept for the packing)
steps_left() { local l=$(( steps_end - $(date +%s) )); [ $l -gt 5 ] && echo $l || echo 5; }
step() { local gpu=$1 name=$2 cap=$3; shift 3; local t; t=$(steps_left); [ "$t" -gt "$cap" ] && t=$cap
  ( export CUDA_VISIBLE_DEVICES=$gpu; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc=$? $(date -u +%T)" >> "$O/$name.log" ); }
steps_start() { O=$1; mkdir -p "$O"
  python -m pip install --no-deps --no-build-isolation -q -e . > "$O/install.log" 2>&1
  nvidia-smi -L > "$O/gpus.txt" 2>&1
  export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
  steps_budget "$2"      # (before the bytecode prime: its seconds are the command's too)
  steps_bytecode; }
# Python's bytecode kept for every process of the command, as an install that compiled it (pip's default) has it:
# the device image's site-packages keeps none, so each process compiled torch's, transformers' and triton's sources
# again (2.6-2.9 s of a warm optimize in runs/optimize_time/run17-h200-warm-profile, every side alike). The heavy
# modules are imported once first, so that no side's process is the one that pays it; bytecode.log says whether the
# cache took (the second import's seconds against the first's).
steps_bytecode() { unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
  local prime='import sys, time; t = time.time()
import torch, torch._dynamo, torch._inductor.compile_fx, torch.export, triton, transformers, accelc, accelc.api
from transformers.models.bert import modeling_bert
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.gpt2 import modeling_gpt2
print("imports", round(time.time() - t, 1), "s; bytecode written:", not sys.dont_write_bytecode, sys.pycache_prefix)
if len(sys.argv) > 1 and torch.cuda.is_available():   # what a first compile imports too: Inductor codegen, accelc stages
    t = time.time()
    x = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    torch.compile(lambda a: (a.sin() + 1).sum(-1))(x)
    accelc.optimize(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda().half(), (x,))
    print("a compile and an optimize", round(time.time() - t, 1), "s")'
  local c; c=$(mktemp -d)     # (the prime's kernels in caches of its own: a side's cold caches stay cold)
  { env ACCELC_CACHE_DIR=$c/accelc TRITON_CACHE_DIR=$c/triton TORCHINDUCTOR_CACHE_DIR=$c/inductor timeout 120 \
        python -c "$prime" compile; timeout 60 python -c "$prime"; } > "$O/bytecode.log" 2>&1; rm -rf "$c"; }
lanes_run() { local root=$1 lanes=$2 name; set -u
  steps_start "$root/setup" "$3"; tar czf "$OUT/setup.tgz" -C "$O" .
  for name in ${lanes//,/ }; do O=$root/$name; mkdir -p "$O"; lane "$name"; tar czf "$OUT/$name.tgz" -C "$O" .; done; }
