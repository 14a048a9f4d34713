#!/bin/sh
# Idempotent setup of what graphtrain's build and tests need from the system:
# - Debian's LLVM 22, and a stand-in for the LLVM bundle tracel-llvm-bundler (23.1.0-4, used by
#   cubecl-cpu 0.11.x) would download from GitHub, so the cpu backend builds offline;
# - Mesa's lavapipe (a Vulkan driver on the CPU) and the Vulkan loader, so the wgpu backend runs
#   on a machine without a GPU;
# - OpenMPI (mpirun and its headers) and libclang, which the `mpi` crate's bindings are generated
#   with, for ranks as processes (`--launcher mpi`).
# Usage:  eval "$(sh scripts/setup.sh)"   (prints the XDG_DATA_HOME the build must see, and an
# XDG_RUNTIME_DIR, which Vulkan's loader wants to exist)
set -eu
PKGS="llvm-22-dev libpolly-22-dev libzstd-dev mesa-vulkan-drivers libvulkan1 openmpi-bin libopenmpi-dev libclang-dev coinor-libcbc-dev"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing:$missing" >&2
  # apt writes progress to stdout, which the caller evals: send it to stderr.
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends $missing >&2
else
  echo "apt packages already installed" >&2
fi
[ -x /usr/lib/llvm-22/bin/llvm-config ] || { echo "missing /usr/lib/llvm-22/bin/llvm-config" >&2; exit 1; }

XDG="${XDG_DATA_HOME:-$HOME/.local/share}"
DIR="$XDG/tracel/tracel-llvm-23.1.0-4"
mkdir -p "$DIR/bin"
: > "$DIR/.tracel-llvm-installed"
cat > "$DIR/bin/llvm-config.tmp" <<'SH'
#!/bin/sh
# Wrapper: Debian LLVM 22, absolute /path/libNAME.so words rewritten to -lNAME
out=$(/usr/lib/llvm-22/bin/llvm-config "$@") || exit $?
printf '%s\n' "$out" | sed -E 's#/[^ ]*/lib([A-Za-z0-9_+-]+)\.so#-l\1#g'
SH
chmod +x "$DIR/bin/llvm-config.tmp"
mv -f "$DIR/bin/llvm-config.tmp" "$DIR/bin/llvm-config"
"$DIR/bin/llvm-config" --version >/dev/null
echo "LLVM bundle stub ready at $DIR (llvm-config $("$DIR/bin/llvm-config" --version))" >&2
echo "export XDG_DATA_HOME=$XDG"
RUNTIME="${XDG_RUNTIME_DIR:-/tmp/graphtrain-runtime-$(id -u)}"
mkdir -p "$RUNTIME" && chmod 0700 "$RUNTIME"
echo "export XDG_RUNTIME_DIR=$RUNTIME"
