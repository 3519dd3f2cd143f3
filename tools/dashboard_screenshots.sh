#!/usr/bin/env bash
# The README's screenshots of the dashboard (docs/dashboard-*.png): the overview, a job's
# page, its log and a rank's log, taken by headless Chromium (tools/dashboard_screenshots.py)
# of the demo's job on two CPU trainers, on a head of its own (state in a temporary
# folder), which it stops at the end.
#
#   tools/dashboard_screenshots.sh [OUT_DIR]     (IMGRUN: the binary, default release)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${1:-docs}"
out=$(realpath "${1:-docs}")
command -v chromium >/dev/null || { echo "no chromium (Debian's package)" >&2; exit 1; }
script=$(realpath tools/dashboard_screenshots.py)
python=$(bash tools/pytools.sh)
source tools/demo_cluster.sh
demo_cluster demo 40
record=$IMGRUN_STATE_DIR/dashboard.json
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$record" "$1"; }
"$python" "$script" "$(field url)#token=$(field token)" "$out" \
    overview= job=job/demo log=job/demo/log rank-log=job/demo/rank/1/log
