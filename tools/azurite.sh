#!/usr/bin/env bash
# Prints the path of Azurite's blob server (`azurite-blob`, Microsoft's Azure Storage
# emulator), installing it from the npm registry on first use. The az:// tests start it on
# loopback.
#
#   azurite=$(tools/azurite.sh)
#
# It lives in ${IMGRUN_CACHE:-~/.cache/imgrun}/azurite-VERSION (a `.complete` file marks a
# finished install). Exits 2, with a last line that says what is missing, when npm is not
# on this machine or its registry cannot be reached, so that callers can tell a missing
# precondition from a real failure; other failures exit 1.
set -euo pipefail

# 3.37 asks for Node.js 22 in its package.json; its blob server runs on Node.js 20 too
# (npm warns, EBADENGINE), which is what this machine has.
version=3.37.0
cache=${IMGRUN_CACHE:-$HOME/.cache/imgrun}
dir=$cache/azurite-$version
bin=$dir/node_modules/.bin/azurite-blob

mkdir -p "$cache"
exec 9>"$cache/azurite.lock"
flock 9

if [ ! -f "$dir/.complete" ]; then
    if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
        echo "no npm: tools/azurite.sh installs Azurite with npm (install nodejs and npm)" >&2
        exit 2
    fi
    echo "tools/azurite.sh: installing azurite@$version into $dir (once, about 360 MB)" >&2
    rm -rf "$dir"
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    if ! npm install --prefix "$dir" --no-audit --no-fund --loglevel=error \
        "azurite@$version" >"$log" 2>&1; then
        cat "$log" >&2
        rm -rf "$dir"
        if grep -qiE 'ENOTFOUND|ECONNREFUSED|ETIMEDOUT|EAI_AGAIN|network' "$log"; then
            echo "npm registry unreachable: tools/azurite.sh could not download azurite@$version" >&2
            exit 2
        fi
        echo "tools/azurite.sh: npm install failed (see above)" >&2
        exit 1
    fi
    touch "$dir/.complete"
fi
echo "$bin"
