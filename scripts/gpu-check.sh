#!/usr/bin/env bash
# What a lent NVIDIA GPU should run, in one go and in under 8 minutes, so that its minutes go to
# running and not to deciding what to run:
#
#   1. builds graphtrain with `--features cuda` (release);
#   2. numerics: `tiny`, 5 steps of fixed data, on cuda (fused) and on the reference
#      interpreter; every loss must agree within 1e-4 relative, or the script fails; and cuda
#      with CUDA graphs (the default) must print the losses it prints without them
#      (`--tuning device_graphs=off`), digit for digit;
#   3. speed: `bench` on `peer` and on two layers at 8b's width (dim 4096, ffn 14336, 32/8
#      heads, vocab 32000, seq 1024), f32, with and without CUDA graphs, tokens/s and MFU as
#      `bench` prints them (on `peer` also with the one-unit-per-output matmul instead of the
#      tiled one); then the same with `--precision bf16-mixed` (on cuda its matmuls sum in f32
#      and round to bf16: no tensor cores yet).
#
#   scripts/gpu-check.sh [OUT_DIR]
#
# GPU_CHECK_BACKEND (default cuda) and GPU_CHECK_FEATURES (default cuda) let the script be tried
# where there is no NVIDIA GPU: `GPU_CHECK_BACKEND=wgpu GPU_CHECK_FEATURES=wgpu` on lavapipe.
# OUT_DIR defaults to $OUT (set on the lent machine) or ./gpu-check-out. Every command's output
# goes to OUT_DIR/NAME.log and one line per check to OUT_DIR/summary.txt. `bench` prints how
# many of the Program's steps its device graphs replay.
set -uo pipefail
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
started=$SECONDS
backend="${GPU_CHECK_BACKEND:-cuda}"
features="${GPU_CHECK_FEATURES:-cuda}"

say "gpu-check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1 \
  && say "gpu: $(head -1 "$out/gpu.txt")" || say "gpu: nvidia-smi failed (see $out/gpu.txt)"

# 1. Build.
if ! timeout 300 cargo build --release --features "$features" >"$out/build.log" 2>&1; then
  say "build: FAILED after $((SECONDS - started)) s (see $out/build.log)"
  exit 1
fi
say "build: ok in $((SECONDS - started)) s"
bin="${CARGO_TARGET_DIR:-target}/release/graphtrain"

# `step: N loss: X` lines -> "N X"
losses() { sed -nE 's/^step: +([0-9]+) loss: ([-0-9.eE+naNif]+).*/\1 \2/p' "$1"; }

# 2. Numerics on tiny.
status=0
for b in reference "$backend"; do
  timeout 120 "$bin" run --config tiny --steps 5 --data fixed --backend "$b" \
    >"$out/tiny-$b.log" 2>&1 || { say "tiny on $b: FAILED (see $out/tiny-$b.log)"; status=1; }
done
timeout 120 "$bin" run --config tiny --steps 5 --data fixed --backend "$backend" \
  --tuning device_graphs=off >"$out/tiny-$backend-no-graphs.log" 2>&1 ||
  { say "tiny on $backend without device graphs: FAILED"; status=1; }
if [ "$(losses "$out/tiny-$backend.log")" = "$(losses "$out/tiny-$backend-no-graphs.log")" ] &&
  [ -n "$(losses "$out/tiny-$backend.log")" ]; then
  say "numerics: tiny, 5 steps, $backend with device graphs prints the losses it prints without: ok"
else
  say "numerics: tiny, $backend with and without device graphs: MISMATCH"
  paste <(losses "$out/tiny-$backend.log") <(losses "$out/tiny-$backend-no-graphs.log") | tee -a "$summary"
  status=1
fi
if [ "$status" = 0 ]; then
  if paste <(losses "$out/tiny-reference.log") <(losses "$out/tiny-$backend.log") | awk '
      NF != 4 || $1 != $3 { bad = 1; next }
      { d = $2 - $4; if (d < 0) d = -d; s = $2 < 0 ? -$2 : $2;
        if (!(d <= 1e-4 * s) || $4 != $4) bad = 1; n++ }
      END { exit (bad || n != 5) }'; then
    say "numerics: tiny, 5 steps, $backend within 1e-4 of the interpreter: ok"
  else
    say "numerics: tiny, $backend against the interpreter: MISMATCH"
    paste <(losses "$out/tiny-reference.log") <(losses "$out/tiny-$backend.log") | tee -a "$summary"
    status=1
  fi
fi

# 3. Speed.
"$bin" config show 8b | sed -E 's/n_layers: [0-9]+/n_layers: 2/; s/seq_len: [0-9]+/seq_len: 1024/; s/vocab_size: [0-9]+/vocab_size: 32000/' \
  >"$out/8b-width.ron"
bench() { # NAME CONFIG EXTRA...
  local name="$1" config="$2"
  shift 2
  if timeout 150 "$bin" bench --config "$config" --backend "$backend" --steps 5 --warmup 2 "$@" \
    >"$out/$name.log" 2>&1; then
    say "$name: $(grep -E '^summary:' "$out/$name.log" | sed 's/^summary: //')"
    grep -E '^device graphs:' "$out/$name.log" | sed "s/^/$name: /" | tee -a "$summary"
  else
    say "$name: did not run: $(grep -vE '^step' "$out/$name.log" | tail -1)"
  fi
}
for config in peer 8b-width; do
  file="$config"
  [ "$config" = 8b-width ] && file="$out/8b-width.ron"
  bench "$config-f32" "$file" --passes default
  bench "$config-f32-no-graphs" "$file" --passes default --tuning device_graphs=off
  # The tiled matmul is cuda's default; the one-unit-per-output kernel beside it, on peer only
  # (at 8b's width it would take minutes).
  [ "$config" = peer ] && bench "$config-f32-per-output-matmul" "$file" --passes default --tuning device_matmul=per_output
  bench "$config-bf16" "$file" --passes default --precision bf16-mixed
  if [ $((SECONDS - started)) -gt 420 ]; then
    say "stopping early: $((SECONDS - started)) s spent"
    break
  fi
done
say "done in $((SECONDS - started)) s"
exit "$status"
