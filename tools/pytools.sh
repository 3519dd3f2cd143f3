#!/usr/bin/env bash
# Prints the path of a Python that has the `webdataset` library, creating the cached
# virtual environment on first use. The interop tests and the read benchmark use it to
# check imgrun against the real Python library; the s3:// tests run moto's S3 server and
# the `aws` CLI from the same venv (`bin/aws`, beside the printed Python).
#
#   python=$(tools/pytools.sh)
#
# The venv lives in ${IMGRUN_CACHE:-~/.cache/imgrun}/pytools and is built once (a
# `.complete` file, which lists its packages, marks a finished one; a half-built venv, or
# one made for other packages, is rebuilt). Exits 2, with a
# last line that says what is missing, when something it needs is not on this machine
# (no `python3`, no `venv` module) or PyPI cannot be reached, so that callers can tell a
# missing precondition from a real failure; other failures exit 1.
set -euo pipefail

# prometheus-client: its parser reads the dashboard's `/metrics` in the tests;
# websocket-client: drives headless Chromium through its DevTools protocol;
# moto[server]: a real S3 API on loopback (`python -m moto.server`) for the s3:// tests;
# awscli: `aws s3 cp`, what Python webdataset users pipe their shards through, for the
# interop tests and the benchmark (it also fills and reads moto's buckets in the tests);
# azure-storage-blob: Microsoft's own client, which makes, fills and reads Azurite's
# containers in the az:// tests (tests/python/azure_blob.py);
# kubernetes-validate, check-jsonschema, pyyaml: offline checks of `imgrun k8s manifest`'s
# YAML against Kubernetes' own schemas and the CRDs' (tests/python/k8s_validate.py).
packages=("webdataset>=1.0,<1.1" "pillow" "numpy" "prometheus-client==0.26.0" "websocket-client==1.9.2"
    "moto[server]==5.2.5" "awscli==1.46.3" "azure-storage-blob==12.31.1"
    "kubernetes-validate==1.37.0" "check-jsonschema==0.39.0" "pyyaml==6.0.4")

cache=${IMGRUN_CACHE:-$HOME/.cache/imgrun}
venv=$cache/pytools
python=${PYTHON:-python3}

mkdir -p "$cache"
# One builder at a time: the interop tests and the benchmark may start together.
exec 9>"$cache/pytools.lock"
flock 9

if [ ! -f "$venv/.complete" ] || [ "$(cat "$venv/.complete")" != "${packages[*]}" ]; then
    echo "tools/pytools.sh: installing ${packages[*]} into $venv (once, about 100 MB)" >&2
    rm -rf "$venv"
    if ! command -v "$python" >/dev/null; then
        echo "no Python: tools/pytools.sh cannot find '$python' (install python3)" >&2
        exit 2
    fi
    if ! "$python" -m venv "$venv" >&2; then
        rm -rf "$venv"
        echo "no venv module: '$python -m venv' failed (install python3-venv)" >&2
        exit 2
    fi
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    if ! "$venv/bin/pip" install --quiet --disable-pip-version-check --timeout 30 --retries 1 \
        "${packages[@]}" >"$log" 2>&1; then
        cat "$log" >&2
        rm -rf "$venv"
        if grep -qiE 'NewConnectionError|Max retries exceeded|Name or service not known|name resolution|Network is unreachable|ConnectTimeout|ReadTimeout|ProxyError|SSLError|Could not fetch URL' "$log"; then
            echo "PyPI unreachable: tools/pytools.sh could not download ${packages[*]}" >&2
            exit 2
        fi
        echo "tools/pytools.sh: pip install failed (see above)" >&2
        exit 1
    fi
    echo "${packages[*]}" >"$venv/.complete"
fi

echo "$venv/bin/python"
