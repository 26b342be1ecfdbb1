#!/usr/bin/env bash
# Each kernel's DRAM bytes and time for one call per T, by Nsight Compute's counters (tools/dram.py
# says what is run and what the least bytes are). ncu leaves the clocks alone (--clock-control none)
# and flushes the caches before each kernel, as a call that streams 13 GB of weights finds them.
#
#   bash tools/dram.sh 8192,16384 [MODULE.py]      # CSV under ${OUT:-results/dram}, the table on stdout
set -eu
cd "$(dirname "$(realpath "$0")")/.."
tokens=${1:?usage: dram.sh T[,T...] [MODULE.py]}
OUT=${OUT:-results/dram}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
for T in ${tokens//,/ }; do
  ncu --clock-control none --nvtx --nvtx-include "call-$T/" \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
    --csv --print-units base python3 tools/dram.py "$T" "${@:2}" > "$OUT/ncu_T$T.csv" 2> "$OUT/ncu_T$T.err" || {
      tail -20 "$OUT/ncu_T$T.err"; exit 1; }
  grep -v '^"' "$OUT/ncu_T$T.csv" | grep -v '^==PROF==' | tail -3
  python3 tools/dram.py --csv "$OUT/ncu_T$T.csv"
done
