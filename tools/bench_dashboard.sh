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
imgrun=${IMGRUN:-target/release/imgrun}
[ -x "$imgrun" ] || { echo "no $imgrun: build it (cargo build --release) or set IMGRUN" >&2; exit 1; }
imgrun=$(realpath "$imgrun")
examples=$(realpath examples)
script=$(realpath tools/bench_dashboard.py)
work=$(mktemp -d)
export IMGRUN_STATE_DIR=$work/state
cleanup() {
    "$imgrun" stop --all >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
cd "$work"
"$imgrun" shards synth train --per-class 200 --maxcount 250 --seed 1 --prefix t >/dev/null 2>&1
"$imgrun" shards synth val --per-class 40 --maxcount 250 --seed 2 --prefix v >/dev/null 2>&1
"$imgrun" start --head --port 0 --num-gpus 0 >/dev/null
"$imgrun" train --config "$examples/demo.toml" --name bench \
    --set 'data.train=train/t-{000000..000007}.tar' --set 'data.val=val/v-{000000..000001}.tar' \
    --set train.epochs=1000 --set train.cpu_trainers=2 --detach >/dev/null 2>&1
until [ -s runs/bench/metrics.jsonl ] && grep -q '"kind":"step"' runs/bench/metrics.jsonl; do sleep 1; done
sleep 10
record=$IMGRUN_STATE_DIR/dashboard.json
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$record" "$1"; }
pid=$(python3 -c "import json,glob; print([json.load(open(f))['pid'] for f in glob.glob('$IMGRUN_STATE_DIR/daemons/*.json')][0])")
echo "head pid $pid; $(nproc) cores; job: the demo's small CNN on two CPU trainers"
python3 "$script" "$(field url)" "$(field token)" bench "$work/runs/bench" "$pid" "$seconds" "$pages"
