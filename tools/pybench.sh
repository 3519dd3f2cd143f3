#!/usr/bin/env bash
# Prints the path of a Python with torch, torchvision, safetensors, TensorBoard's event
# reader, `webdataset`, Pillow and NumPy, creating the cached virtual environment on first use. The loader benchmark
# uses it to time the usual PyTorch input pipeline on the same shards as imgrun; the
# export tests (tests/e2e/export.rs) load imgrun's weights into torchvision with it.
#
#   python=$(tools/pybench.sh)
#
# Nothing already cached is installed again: the venv lives in
# ${IMGRUN_CACHE:-~/.cache/imgrun}/pybench, holds only torchvision, safetensors, packaging,
# tensorboard, protobuf and absl-py (none depends at run time on anything but torch, NumPy
# and each other), and sees the packages
# of the two venvs beside it through a `.pth` file: `pytools` (webdataset, Pillow, NumPy;
# made by tools/pytools.sh when missing) and `torch-2.11.0`, which tools/libtorch.sh
# makes (`make demo` or `make doctor` run it). A missing torch venv is an error rather
# than a silent 4.6 GB download. torchvision is the release built for that torch and is
# installed with --no-deps, so pip never fetches a torch of its own. A `.complete` file
# marks a finished venv; a half-built one is rebuilt. Exits 2 with a message starting
# "PyPI unreachable" when pip cannot download what it needs; other failures exit 1.
set -euo pipefail

torch_version=2.11.0
# The torchvision whose wheel requires torch==2.11.0.
torchvision=torchvision==0.26.0
# safetensors.torch imports `packaging` (pure Python, no dependencies).
safetensors="safetensors==0.7.0 packaging==24.2"
# TensorBoard's event reader (the export tests read imgrun's event files with it) needs
# protobuf and absl-py of its dependencies, not its server's.
tensorboard="tensorboard==2.21.0 protobuf==6.33.1 absl-py==2.3.1"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${IMGRUN_CACHE:-$HOME/.cache/imgrun}
torch_venv=$cache/torch-$torch_version
venv=$cache/pybench

if [ ! -f "$torch_venv/.complete" ]; then
    echo "tools/pybench.sh: no torch venv in $torch_venv; make it once (about 4.6 GB) with: env -u LIBTORCH bash tools/libtorch.sh" >&2
    exit 1
fi
# webdataset, Pillow and NumPy (exits 2 itself when PyPI is unreachable).
pytools_python=$(bash "$here/pytools.sh")

mkdir -p "$cache"
# One builder at a time: two benchmark runs may start together.
exec 9>"$cache/pybench.lock"
flock 9

purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
# The interpreter of the torch venv, so that all three venvs share one Python.
python=$torch_venv/bin/python
shared_sites="$("$pytools_python" -c "$purelib")
$("$python" -c "$purelib")"
# What .complete holds: a venv made for other packages or other shared venvs is rebuilt.
complete="$shared_sites
$torchvision $safetensors $tensorboard"

if [ ! -f "$venv/.complete" ] || [ "$(cat "$venv/.complete")" != "$complete" ]; then
    echo "tools/pybench.sh: installing $torchvision, $safetensors and $tensorboard into $venv (once, about 75 MB)" >&2
    rm -rf "$venv"
    if ! "$python" -m venv "$venv" >&2; then
        echo "tools/pybench.sh: '$python -m venv' failed" >&2
        exit 1
    fi
    # Appended to sys.path after the venv's own site-packages, in this order.
    echo "$shared_sites" >"$("$venv/bin/python" -c "$purelib")/imgrun-shared.pth"
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    if ! "$venv/bin/pip" install --quiet --disable-pip-version-check --timeout 30 --retries 1 \
        --no-deps "$torchvision" $safetensors $tensorboard >"$log" 2>&1; then
        cat "$log" >&2
        rm -rf "$venv"
        if grep -qiE 'NewConnectionError|Max retries exceeded|Name or service not known|name resolution|Network is unreachable|ConnectTimeout|ReadTimeout|ProxyError|SSLError|Could not fetch URL' "$log"; then
            echo "PyPI unreachable: tools/pybench.sh could not download $torchvision, $safetensors and $tensorboard" >&2
            exit 2
        fi
        echo "tools/pybench.sh: pip install failed (see above)" >&2
        exit 1
    fi
    # Catches a Python version that differs between the venvs, too.
    if ! "$venv/bin/python" -W ignore -c 'import torch, torchvision, safetensors.torch, webdataset, PIL, numpy
from tensorboard.backend.event_processing import event_accumulator' >&2; then
        rm -rf "$venv"
        echo "tools/pybench.sh: the new venv cannot import its packages (see above)" >&2
        exit 1
    fi
    echo "$complete" >"$venv/.complete"
fi

echo "$venv/bin/python"
