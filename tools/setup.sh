#!/usr/bin/env bash
# Install everything linepack needs on a fresh Debian 12 machine, idempotently:
# Debian packages, the Python package (editable), the QEMU plugin, and the real
# target kernel (Debian's 6.1 cloud vmlinux, cached under ~/.cache/linepack).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
log() { echo "setup: $*" >&2; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

DEB_PKGS=(gcc g++ make libc6-dev binutils cpio e2fsprogs qemu-system-x86 qemu-user bolt-19 linux-perf
          elfutils libelf-dev libglib2.0-dev pkg-config dpkg-dev python3-pip
          flex bison bc libssl-dev lz4 xz-utils   # the kernel's boot-image build (bzimage)
          llvm-19 gdb   # llvm-dwarfdump/llvm-symbolizer and gdb: the DWARF checks
          lld-19        # LLVM's linker (rustc's): the fixtures linked as lld lays them out (test_relayout_lld)
          ovmf)         # UEFI firmware: a moved decompressor booted through its EFI stub (test_zoroom)
missing=()
for p in "${DEB_PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
# apt lists are needed both to install and to find the newest kernel ABI.
if [ ${#missing[@]} -gt 0 ] || [ -z "$(ls /var/lib/apt/lists/*Packages* 2>/dev/null | head -1)" ] \
   || [ -n "$(find /var/lib/apt/lists -maxdepth 0 -mmin +1440 2>/dev/null)" ]; then
  log "apt-get update"
  $SUDO apt-get update -q >/dev/null
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
if ! "$PY" -c "import linepack, capstone, elftools, numpy, distributed, zstandard, lz4.block" 2>/dev/null \
   || [ "$("$PY" -c 'import linepack,os;print(os.path.realpath(os.path.dirname(linepack.__file__)))')" != "$here/tools" ]; then
  log "pip install -e . (capstone, pyelftools, numpy, dask distributed, zstandard, lz4, pytest)"
  "$PY" -m pip install -q --disable-pip-version-check -e "$here" pytest 2>&1 | grep -v "Running pip as the 'root' user" >&2 || true
fi
# drgn (PyPI): the debug-info consumer check on rewritten kernels' memory dumps
if ! "$PY" -c 'import drgn' 2>/dev/null; then
  log "pip install drgn (debug-info consumer tests)"
  "$PY" -m pip install -q --disable-pip-version-check "drgn>=0.0.25" 2>&1 \
    | grep -v "Running pip as the 'root' user" >&2 || true
fi
"$PY" -c 'import drgn' 2>/dev/null || { echo "setup: drgn could not be installed (pip install drgn)" >&2; exit 1; }
# mkdocs >= 1.6 (PyPI; mkdocs.yml validates anchors): the docs build tests/test_docs.py runs
# with warnings as errors
mkdocs_ok() { "$PY" -c 'import sys, mkdocs; sys.exit(tuple(map(int, mkdocs.__version__.split(".")[:2])) < (1, 6))' 2>/dev/null; }
if ! mkdocs_ok; then
  log "pip install mkdocs (docs build test)"
  "$PY" -m pip install -q --disable-pip-version-check "mkdocs>=1.6" 2>&1 \
    | grep -v "Running pip as the 'root' user" >&2 || true
fi
mkdocs_ok || { echo "setup: mkdocs >= 1.6 could not be installed (pip install 'mkdocs>=1.6')" >&2; exit 1; }

if [ -f tools/profile/plugin/Makefile ]; then
  log "building the QEMU TCG plugin"
  "$PY" -m linepack build-plugin >&2 || { log "plugin build failed"; exit 1; }
fi

if [ "${LINEPACK_SKIP_KERNEL:-0}" != 1 ]; then
  # the vmlinux, and the modules of the same build the tests load (fat/vfat in a rewritten
  # kernel, kyber-iosched with its own tracepoints and jump labels for the torture boot, brd for
  # the ext4 RAM-disk workload): no test skips for want of them
  log "fetching Debian's 6.1 cloud vmlinux and modules of the same build (cached)"
  "$PY" -m linepack fetch --module fs/fat/fat.ko --module fs/fat/vfat.ko \
      --module block/kyber-iosched.ko --module drivers/block/brd.ko \
      --module drivers/firmware/qemu_fw_cfg.ko >/dev/null
  vmlinux="$("$PY" -m linepack fetch)"
  # the boot images (vmlinuz) and the kernels distributions ship without link relocations:
  # Debian 13's 6.12 and trixie-backports' 7.3 (-dbg vmlinux + vmlinuz), read through a
  # private apt state under the cache (the machine's apt sources stay untouched)
  log "fetching the 6.1 vmlinuz and Debian 13's 6.12 and 7.3 cloud kernels (cached)"
  "$PY" -m linepack fetch --vmlinuz >/dev/null
  for series in 6.12 7.3; do
    "$PY" -m linepack fetch --series "$series" >/dev/null
    "$PY" -m linepack fetch --series "$series" --vmlinuz >/dev/null
  done
  # Headers of the same build: the slab-bulk workload's kernel module is built against them.
  rel="$(basename "$(dirname "$vmlinux")")"
  if ! dpkg-query -W -f='${Status}' "linux-headers-$rel" 2>/dev/null | grep -q "ok installed"; then
    log "installing linux-headers-$rel"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
      "linux-headers-$rel" >/dev/null
  fi
fi
log "ready"
