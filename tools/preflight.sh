#!/usr/bin/env bash
# Checks, before anything builds, that this machine has the toolchain the build needs, and
# says which piece is missing instead of letting a build fail deep inside a crate:
#
#   cargo and rustc, at least the workspace's `rust-version` (read from Cargo.toml);
#   a C compiler and a C++ compiler (torch-sys compiles C++ against libtorch; pipelines
#   compiles its libjpeg-turbo shim in C);
#   python3 with venv, unless LIBTORCH names a libtorch of your own (tools/libtorch.sh
#   builds the cached torch venv with them).
#
# It also warns (and goes on) when the disk holding the build folder has less room than
# a fresh build takes: a full disk otherwise shows up as `No space left on device` from
# whichever crate the linker was writing at the time.
#
#   bash tools/preflight.sh        # `make demo`, `make test` and `make install` run it first
#
# Exits 1 after listing everything missing; prints nothing when all is there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

problems=()

# The minimum Rust, from the workspace's own manifest so that it cannot drift.
want=$(sed -n 's/^rust-version = "\([0-9.]*\)"/\1/p' "$root/Cargo.toml" | head -n 1)
if [ -z "$want" ]; then
    problems+=("no rust-version in $root/Cargo.toml ([workspace.package])")
fi

# `a.b[.c]` at least `x.y[.z]`?
version_at_least() {
    local have=$1 need=$2 i h n
    IFS=. read -r -a h <<<"$have"
    IFS=. read -r -a n <<<"$need"
    for i in 0 1 2; do
        if [ "${h[i]:-0}" -gt "${n[i]:-0}" ]; then return 0; fi
        if [ "${h[i]:-0}" -lt "${n[i]:-0}" ]; then return 1; fi
    done
    return 0
}

if ! command -v cargo >/dev/null; then
    problems+=("cargo is not on PATH: install Rust ${want:-} or newer (https://rustup.rs), then open a new shell or run: . \"\$HOME/.cargo/env\"")
elif ! command -v rustc >/dev/null; then
    problems+=("rustc is not on PATH (cargo is, at $(command -v cargo)): install Rust ${want:-} or newer (https://rustup.rs)")
elif [ -n "$want" ]; then
    have=$(rustc --version | sed -n 's/^rustc \([0-9][0-9.]*\).*/\1/p')
    if [ -z "$have" ]; then
        problems+=("cannot read rustc's version from '$(rustc --version)'")
    elif ! version_at_least "$have" "$want"; then
        problems+=("rustc $have ($(command -v rustc)) is older than $want, the workspace's rust-version in Cargo.toml: run 'rustup update stable'")
    fi
fi

# The cc crate takes $CC/$CXX, else cc/c++ (then gcc/g++, clang/clang++).
first_of() {
    local c
    for c in "$@"; do
        if [ -n "$c" ] && command -v "${c%% *}" >/dev/null; then
            echo "$c"
            return 0
        fi
    done
    return 1
}
if ! first_of "${CC:-}" cc gcc clang >/dev/null; then
    problems+=("no C compiler (cc, gcc or clang; or set CC): install one, e.g. 'apt-get install build-essential'")
fi
if ! first_of "${CXX:-}" c++ g++ clang++ >/dev/null; then
    problems+=("no C++ compiler (c++, g++ or clang++; or set CXX), which torch-sys needs to build against libtorch: install one, e.g. 'apt-get install g++' (or build-essential)")
fi

if [ -z "${LIBTORCH:-}" ]; then
    python=${PYTHON:-python3}
    if ! command -v "$python" >/dev/null; then
        problems+=("$python is not on PATH: tools/libtorch.sh makes the cached torch venv with it (or set LIBTORCH=/path/to/libtorch)")
    elif ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
        problems+=("$python ($(command -v "$python")) has no venv/ensurepip module, which tools/libtorch.sh needs for the cached torch venv: install it, e.g. 'apt-get install python3-venv' (or set LIBTORCH=/path/to/libtorch)")
    fi
fi

# A fresh `make test` build folder takes about 12 GB, the cached torch venv about 5.5 GB.
# Only a warning: a build folder or venv that is already there needs far less.
need_gb=12
if [ -z "${LIBTORCH:-}" ] && [ ! -d "${IMGRUN_CACHE:-$HOME/.cache/imgrun}" ]; then
    need_gb=18
fi
target=${CARGO_TARGET_DIR:-$root/target}
probe=$target
while [ ! -d "$probe" ]; do probe=$(dirname "$probe"); done
free_kb=$(df -Pk "$probe" 2>/dev/null | awk 'NR == 2 { print $4 }')
if [ -n "$free_kb" ] && [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    echo "imgrun: warning: $((free_kb / 1024 / 1024)) GB free on the disk of $target; a fresh build needs about $need_gb GB (set CARGO_TARGET_DIR to build elsewhere)" >&2
fi

if [ ${#problems[@]} -gt 0 ]; then
    echo "imgrun: this machine lacks what the build needs:" >&2
    for p in "${problems[@]}"; do
        echo "  - $p" >&2
    done
    exit 1
fi
