#!/usr/bin/env bash
# The seed16 re-tune on a GPU lent by the call (a fixed time per command, nothing kept between
# machines): two stages, each one command, the tuning database carried from the first to the second,
# or both in one command.
#
#   bash tools/lent_gpu.sh tune     # probes over the 16 tokens, the zipf partners, extra probes
#   bash tools/lent_gpu.sh finish   # emit (auto layout, zipf hot rows), bench with the PNG, check
#   bash tools/lent_gpu.sh all      # both, sized for one call of under 600 s
#   bash tools/lent_gpu.sh qwen3    # the committed Qwen3-30B-A3B module: its leaders re-timed on
#                                   # today's templates, re-emitted, benched and checked (a landing
#                                   # that changes every variant's source must bring both modules)
#
# Environment: OUT (a folder the results are copied to, e.g. the lender's $OUT: the database gzipped
# under db/, the module, its bench JSON and PNG under km/), BUDGET (seconds the tune stage may take,
# default 520: what is left after the sweeps goes to EXTRA_T), TL1 and TL2 (the tuner's seconds for
# the uniform and the zipf sweeps; 0 skips one), TL3 (qwen3's re-timing seconds, default 150), ZIPF_T (the zipf sweep's tokens, default
# 1024,512,256,128,64), PROBE (each token's probes, `--probe` syntax, `;`-separated;
# default k64 with and without group_by_expert, NOTES 83 and 89), EXTRA_T and EXTRA_PROBES (one token
# count and its further probes, `;`-separated, tuned with what time is left), BTL and CTL (the
# bench's and the check's seconds), SKEW=1 (finish also benches the module under zipf routing, into
# skew/ beside km/), ANY_GPU=1 (run on a card that is not an H200; otherwise exit 3 before any step).
# Wheels in ./.whl (optuna, SQLAlchemy and their dependencies;
# ./.whl/plot for matplotlib) are installed first where the machine lacks them and has no network.
set -u
stage=${1:?usage: lent_gpu.sh tune|finish|all|qwen3}
case $stage in tune|finish|all|qwen3) ;; *) echo "unknown stage: $stage (tune, finish, all or qwen3)" >&2; exit 2 ;; esac
cd "$(dirname "$(realpath "$0")")/.."
OUT=${OUT:-results/lent}
mkdir -p "$OUT"
site=/tmp/moe-tune-site
if ! python3 -c 'import optuna, sqlalchemy' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl || exit 1
fi
if ! PYTHONPATH=$site python3 -c 'import matplotlib' 2>/dev/null && ls .whl/plot/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $site .whl/plot/*.whl || true
fi
export PYTHONPATH=$PWD:$site:${PYTHONPATH:-}
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
# `moe-tune` without installing the package (the lent machine may have no build tools), under a limit.
mt() { local limit=$1; shift; timeout "$limit" python3 -c 'import sys; from autotune.cli import main; sys.exit(main())' "$@"; }
gpu=$(nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | head -1)
echo "$gpu"
# The seed16 module, its database rows and its bench are the H200's: on another card tune would open
# that card's studies and emit would find no leader (a lender asked for an H200 may hand out an H100).
case $gpu in
  *H200*) ;;
  *) [ "${ANY_GPU:-0}" = 1 ] || { echo "not an H200: $gpu; nothing run (ANY_GPU=1 runs anyway)" >&2; exit 3; } ;;
esac
module=kernels_generated/h200_sm90_e256_h4096_i2048_k8_bfloat16
# Gzipped: the database outgrew what a lender brings back of one file (16 MiB each; the database is past 17 MB).
save() { mkdir -p "$OUT/db"; gzip -c db/moe_tune.sqlite3 > "$OUT/db/moe_tune.sqlite3.gz"; }

tune_stage() {
  BUDGET=${BUDGET:-520}; TL1=${TL1:-285}; TL2=${TL2:-90}; PROBE=${PROBE:-weight_layout=k64;weight_layout=k64,group_by_expert=True}
  local leader_probes=()
  IFS=';' read -ra each <<< "$PROBE"
  for p in "${each[@]}"; do leader_probes+=(--probe "$p"); done
  trap save EXIT
  if [ "$TL1" -gt 0 ]; then
    mt $((TL1 + 30)) tune --tokens 2048,1024,4096,8192,512,256,16384,32768,128,64,32,16,8,4,2,1 \
      --more 0 --retime 1 "${leader_probes[@]}" --time-budget "$TL1" 2>&1 | tail -60
    save
  fi
  if [ "$TL2" -gt 0 ]; then
    mt $((TL2 + 30)) tune --routing zipf --tokens "${ZIPF_T:-1024,512,256,128,64}" \
      --more 0 --retime 1 "${leader_probes[@]}" --time-budget "$TL2" 2>&1 | tail -30
    save
  fi
  spare=$(( $(left) - 20 ))
  if [ -n "${EXTRA_T:-}" ] && [ "$spare" -gt 40 ]; then
    probes=()
    IFS=';' read -ra extra <<< "${EXTRA_PROBES:-}"
    for p in "${extra[@]}"; do probes+=(--probe "$p"); done
    mt "$spare" tune --tokens "$EXTRA_T" --more 0 --time-budget $((spare - 15)) "${probes[@]}" 2>&1 | tail -30
  fi
  mt 60 show 2>&1 | tail -60
}

finish_stage() {
  BTL=${BTL:-330}; CTL=${CTL:-200}
  mkdir -p "$OUT/km"
  mt 120 emit --hot-routing zipf 2>&1 | tail -40
  cp $module.py "$OUT/km/"
  # The bench before the check: under a call's time limit the bench is what the results need.
  mt "$BTL" bench --png $module.bench.png 2>&1 | tail -60
  cp $module.bench.* "$OUT/km/"
  mt "$CTL" check 2>&1 | tail -30
  if [ "${SKEW:-0}" = 1 ]; then  # the module under zipf routing: the README's Skewed routing figures
    mkdir -p "$OUT/skew"
    mt "$BTL" bench --routing zipf --json "$OUT/skew/committed.zipf.bench.json" 2>&1 | tail -25
  fi
}

qwen3_stage() {
  # Qwen3-30B-A3B's experts (NOTES 58), committed beside seed16 and emitted without adaptive rows.
  # Its cases are these eight token counts, not the suite's sixteen: every command names them.
  local cases=(--shape 128,2048,768,8 --tokens 1,4,16,64,256,1024,4096,16384)
  local q3=kernels_generated/h200_sm90_e128_h2048_i768_k8_bfloat16
  TL3=${TL3:-150}; BTL=${BTL:-120}; CTL=${CTL:-60}
  mkdir -p "$OUT/km"
  trap save EXIT
  mt $((TL3 + 30)) tune "${cases[@]}" --more 0 --retime 1 --time-budget "$TL3" 2>&1 | tail -30
  save
  mt 120 emit "${cases[@]}" 2>&1 | tail -20
  cp $q3.py "$OUT/km/"
  mt "$BTL" bench "${cases[@]}" --png $q3.bench.png 2>&1 | tail -30
  cp $q3.bench.* "$OUT/km/"
  mt "$CTL" check "${cases[@]}" 2>&1 | tail -20
}

case $stage in
tune) tune_stage ;;
qwen3) qwen3_stage ;;
finish) finish_stage ;;
all)
  # Both stages in one call (one start): on a fresh H100 the finish stage took ~115 s (bench 102 s,
  # check 12 s) and the tune stage its sweeps' seconds plus ~35 s, so these defaults end in ~510 s.
  # TL1 is sized to ~4 trials a case: the leader's re-timing, the two probes, and group_by_expert on
  # the rows layout (a parameter the leaders predate, which the tuner probes by itself).
  BUDGET=${BUDGET:-370}; TL1=${TL1:-280}; TL2=${TL2:-55}; BTL=${BTL:-200}; CTL=${CTL:-60}
  tune_stage
  finish_stage
  ;;
esac
