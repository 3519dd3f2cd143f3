#!/usr/bin/env bash
# Checks the crate dependency direction that ARCHITECTURE.md promises:
#   pipelines and runtime depend neither on each other nor on tch/torch-sys;
#   actors depends on both; only the binary and actors link libtorch.
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0
# The crates' dependency names, or the run ends: a tree that cannot be read checks nothing.
deps() { # crate, cargo tree options...
    local out
    if ! out=$(cargo tree --locked -p "$1" "${@:2}" --prefix none); then
        echo "check-deps: cannot read the dependency tree of $1 (cargo tree failed above)" >&2
        exit 1
    fi
    awk '{print $1}' <<<"$out"
}
forbid() { # crate, forbidden dependency
    if deps "$1" -e normal,build | grep -qx "$2"; then
        echo "check-deps: $1 must not depend on $2" >&2
        fail=1
    fi
}
require() { # crate, required dependency
    if ! deps "$1" -e normal --depth 1 | grep -qx "$2"; then
        echo "check-deps: $1 should depend on $2" >&2
        fail=1
    fi
}

for lib in pipelines runtime; do
    for banned in tch torch-sys actors imgrun; do forbid "$lib" "$banned"; done
done
forbid pipelines runtime
forbid runtime pipelines
require actors pipelines
require actors runtime
require actors tch

if [ "$fail" -ne 0 ]; then exit 1; fi
echo "check-deps: dependency direction ok (pipelines, runtime <- actors <- imgrun; tch only in actors and imgrun)"

# Within a crate: no new circle among the files of one folder (tools/circles.allow lists
# the circles the code still has; it only shrinks).
python3 "$(dirname "$0")/check-circles.py"

# ARCHITECTURE.md's code map names every source file.
python3 "$(dirname "$0")/check-codemap.py"

# No function over its folder's limit in the folders that keep them short (actors/src/job).
python3 "$(dirname "$0")/check-fn-length.py"

# The libtorch-free build (`cargo test -p pipelines -p runtime`) turns on the same features
# of the dependencies it shares with the libtorch build, so they compile once.
python3 "$(dirname "$0")/check-feature-union.py"
