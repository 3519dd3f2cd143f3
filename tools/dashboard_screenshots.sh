#!/usr/bin/env bash
# The README's screenshots of the dashboard (docs/dashboard-*.png): the overview, a job's
# page, its log and a rank's log, taken by headless Chromium (tools/dashboard_screenshots.py)
# of the demo's job on two CPU trainers, on a head of its own (state in a temporary
# folder), which it stops at the end.
#
#   tools/dashboard_screenshots.sh [OUT_DIR]     (IMGRUN: the binary, default release)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath "${1:-docs}")
imgrun=${IMGRUN:-target/release/imgrun}
[ -x "$imgrun" ] || { echo "no $imgrun: build it (cargo build --release) or set IMGRUN" >&2; exit 1; }
command -v chromium >/dev/null || { echo "no chromium (Debian's package)" >&2; exit 1; }
imgrun=$(realpath "$imgrun")
examples=$(realpath examples)
script=$(realpath tools/dashboard_screenshots.py)
python=$(bash tools/pytools.sh)
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
"$imgrun" train --config "$examples/demo.toml" --name demo \
    --set 'data.train=train/t-{000000..000007}.tar' --set 'data.val=val/v-{000000..000001}.tar' \
    --set train.epochs=1000 --set train.cpu_trainers=2 --detach >/dev/null 2>&1
until [ -s runs/demo/metrics.jsonl ] && [ "$(grep -c '"kind":"step"' runs/demo/metrics.jsonl)" -ge 40 ]; do sleep 1; done
record=$IMGRUN_STATE_DIR/dashboard.json
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$record" "$1"; }
"$python" "$script" "$(field url)#token=$(field token)" "$out" \
    overview= job=job/demo log=job/demo/log rank-log=job/demo/rank/1/log
