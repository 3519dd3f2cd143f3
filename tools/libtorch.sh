#!/usr/bin/env bash
# Prints `export` lines that point tch at a libtorch, creating the cached
# torch==2.11.0 virtual environment on first use.
#
#   eval "$(tools/libtorch.sh)"
#
# A user's own LIBTORCH (a libtorch folder with lib/ and include/) is honoured as is.
# Otherwise the venv lives in ${IMGRUN_CACHE:-~/.cache/imgrun}/torch-2.11.0 and is
# built once; later calls only print the exports.
set -euo pipefail

torch_version=2.11.0

if [ -n "${LIBTORCH:-}" ]; then
    if [ ! -d "$LIBTORCH/lib" ]; then
        echo "tools/libtorch.sh: LIBTORCH=$LIBTORCH has no lib/ folder" >&2
        exit 1
    fi
    echo "export LIBTORCH='$LIBTORCH'"
    echo "export IMGRUN_LIBTORCH_LIB='$LIBTORCH/lib'"
    exit 0
fi

cache=${IMGRUN_CACHE:-$HOME/.cache/imgrun}
venv=$cache/torch-$torch_version
python=${PYTHON:-python3}

if [ ! -f "$venv/.complete" ]; then
    echo "tools/libtorch.sh: installing torch==$torch_version into $venv (once, about 4.6 GB)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$torch_version" >&2
    touch "$venv/.complete"
fi

lib=$("$venv/bin/python" -W ignore -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
echo "export LIBTORCH_USE_PYTORCH=1"
echo "export PATH='$venv/bin':\"\$PATH\""
echo "export VIRTUAL_ENV='$venv'"
echo "export IMGRUN_LIBTORCH_LIB='$lib'"
