#!/usr/bin/env bash
# graphtrain against torch.compile on `peer`, in alternated rounds: this host's speed drifts by
# 1.5x within minutes, so only rounds run back to back compare, and the median ratio over many
# rounds is the figure docs/benchmarks.md reports. Run it with nothing else busy.
#
#   scripts/vs_torch.sh [ROUNDS] [TORCH_PEER_DIR] [PRECISION]
#
# ROUNDS defaults to 6; TORCH_PEER_DIR to ../shared/peers/torch, where `install.sh` must have
# made `venv/`; PRECISION to f32 (`bf16-mixed`: ours with `--precision bf16-mixed`, torch with
# `--autocast bf16`). graphtrain must be built (`cargo build --release`); CARGO_TARGET_DIR is honoured.
# Prints one line per round (median and best tok/s of each, and the ratio of the medians), then
# the median ratio.
set -euo pipefail
rounds="${1:-6}"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "vs_torch.sh: ROUNDS must be a positive integer, not '$rounds'" >&2; exit 2; }
# A peer directory given relative to where the script was called from.
if [ -n "${2:-}" ]; then peer="$(cd "$2" && pwd)"; fi
cd "$(dirname "$0")/.."
peer="${peer:-../shared/peers/torch}"
precision="${3:-f32}"
case "$precision" in
  f32) ours_flags=(); theirs_flags=() ;;
  bf16-mixed) ours_flags=(--precision bf16-mixed); theirs_flags=(--autocast bf16) ;;
  *) echo "vs_torch.sh: PRECISION is f32 or bf16-mixed, not '$precision'" >&2; exit 2 ;;
esac
bin="${CARGO_TARGET_DIR:-target}/release/graphtrain"
[ -x "$bin" ] || { echo "vs_torch.sh: no $bin; run cargo build --release first" >&2; exit 1; }
[ -x "$peer/venv/bin/python" ] || {
  echo "vs_torch.sh: no PyTorch in $peer/venv; run $peer/install.sh first" >&2
  exit 1
}

# `summary:` line -> "median_tps best_tps"
tps() { sed -nE 's/^summary: median_tps: ([0-9]+) best_tps: ([0-9]+).*/\1 \2/p'; }

ratios=()
for i in $(seq 1 "$rounds"); do
  ours=$("$bin" bench --model llama3 --config peer --backend cpu --steps 20 --warmup 3 \
    ${ours_flags[@]+"${ours_flags[@]}"} | tps)
  theirs=$("$peer/venv/bin/python" "$peer/llama_step.py" --mode compile --threads 2 \
    --steps 20 --warmup 3 ${theirs_flags[@]+"${theirs_flags[@]}"} | tps)
  [ -n "$ours" ] && [ -n "$theirs" ] || { echo "vs_torch.sh: a run printed no summary" >&2; exit 1; }
  ratio=$(awk -v o="${ours%% *}" -v t="${theirs%% *}" 'BEGIN { printf "%.3f", o / t }')
  ratios+=("$ratio")
  echo "round $i $(date +%T) load $(cut -d' ' -f1 /proc/loadavg): graphtrain ${ours% *} (best ${ours#* }) torch.compile ${theirs% *} (best ${theirs#* }) tok/s, ratio $ratio"
done
printf '%s\n' "${ratios[@]}" | sort -n |
  awk '{ r[NR] = $1 } END { m = (NR % 2) ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2;
         printf "median ratio over %d rounds: %.3f (graphtrain / torch.compile tok/s)\n", NR, m }'
