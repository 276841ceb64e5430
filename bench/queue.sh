#!/usr/bin/env bash
# Runs entries of bench/device_queue on the device (logs and results under /tmp/queue/<name>, each packed into
# $OUT/<name>.tgz; the install, GPU list and bytecode prime once a command, in setup.tgz):
#   bash bench/queue.sh NAME[,NAME...] [SECONDS]     # SECONDS: the command's budget (570)
#   bash bench/queue.sh --list                       # the queue, in order
set -u
cd "$(dirname "$0")/.."
entries() { grep -v '^\s*#' bench/device_queue | grep -v '^\s*$'; }
if [ "${1:-}" = --list ]; then entries | awk '{print $1, $2 " s"}'; exit 0; fi
. bench/steps.sh
lane() { local line cap cmd
  line=$(entries | awk -v n="$1" '$1 == n' | head -1)
  if [ -z "$line" ]; then echo "no entry $1 in bench/device_queue" > "$O/error.log"; return; fi
  cap=$(echo "$line" | awk '{print $2}'); cmd=$(echo "$line" | cut -d' ' -f3-)
  echo "$cmd" > "$O/command.txt"
  step "${CUDA_VISIBLE_DEVICES:-0}" "$1" "$cap" env O="$O" bash -c "$cmd"; }
lanes_run /tmp/queue "$1" "${2:-570}"
