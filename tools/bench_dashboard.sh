#!/usr/bin/env bash
# The head's dashboard under a running job: first load, step-to-page delay, and the head's
# CPU and memory with no page and with PAGES pages following the job (figures in
# docs/benchmarks.md). Starts a head of its own (state in a temporary folder), the demo's
# job on synthetic shards with two CPU trainers, measures with tools/bench_dashboard.py,
# and stops everything.
#
#   tools/bench_dashboard.sh [SECONDS] [PAGES]     (IMGRUN: the binary, default release)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
pages=${2:-5}
script=$(realpath tools/bench_dashboard.py)
source tools/demo_cluster.sh
demo_cluster bench 1
sleep 10
record=$IMGRUN_STATE_DIR/dashboard.json
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$record" "$1"; }
pid=$(python3 -c "import json,glob; print([json.load(open(f))['pid'] for f in glob.glob('$IMGRUN_STATE_DIR/daemons/*.json')][0])")
echo "head pid $pid; $(nproc) cores; job: the demo's small CNN on two CPU trainers"
python3 "$script" "$(field url)" "$(field token)" bench "$work/runs/bench" "$pid" "$seconds" "$pages"
