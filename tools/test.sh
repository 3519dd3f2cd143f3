#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs (libtorch in a cached
# venv, Python webdataset for the interop tests), then format, dependency direction,
# clippy, every test, and the README's main command (`make demo`) from the checkout root.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "formatting"
cargo fmt --all --check

step "crates that must not need libtorch build and test without it"
(
    unset LIBTORCH LIBTORCH_USE_PYTORCH LIBTORCH_LIB LIBTORCH_INCLUDE
    cargo test --locked -p pipelines -p runtime
)

step "libtorch (cached in ${IMGRUN_CACHE:-$HOME/.cache/imgrun})"
eval "$(bash tools/libtorch.sh)"

step "dependency direction"
bash tools/check-deps.sh

step "clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings

step "tests of the binary and the actors (with libtorch)"
cargo test --locked -p imgrun -p actors

step "the main job: make demo from the checkout root, as the README says (fails below its accuracy bar)"
make demo
