# Sourced (not run) by the tools that need the demo's job on a cluster of their own
# (bench_dashboard.sh, dashboard_screenshots.sh), from the repository's root:
#
#   source tools/demo_cluster.sh
#   demo_cluster NAME STEPS
#
# Checks $IMGRUN (default target/release/imgrun) and sets $imgrun to its full path; makes a
# temporary folder ($work, removed at exit, with the head's state in $work/state, which
# $IMGRUN_STATE_DIR names), synthetic shards in it, a head (stopped at exit) and the
# demo's job NAME on two CPU trainers, detached; and returns in $work once the job has
# written STEPS steps. Exits the caller when something is missing.

demo_cluster() {
    local name=$1 steps=$2
    imgrun=${IMGRUN:-target/release/imgrun}
    [ -x "$imgrun" ] || { echo "no $imgrun: build it (cargo build --release) or set IMGRUN" >&2; exit 1; }
    imgrun=$(realpath "$imgrun")
    local examples
    examples=$(realpath examples)
    work=$(mktemp -d)
    export IMGRUN_STATE_DIR=$work/state
    trap '"$imgrun" stop --all >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
    cd "$work"
    "$imgrun" shards synth train --per-class 200 --maxcount 250 --seed 1 --prefix t >/dev/null 2>&1
    "$imgrun" shards synth val --per-class 40 --maxcount 250 --seed 2 --prefix v >/dev/null 2>&1
    "$imgrun" start --head --port 0 --num-gpus 0 >/dev/null
    "$imgrun" train --config "$examples/demo.toml" --name "$name" \
        --set 'data.train=train/t-{000000..000007}.tar' --set 'data.val=val/v-{000000..000001}.tar' \
        --set train.epochs=1000 --set train.cpu_trainers=2 --detach >/dev/null 2>&1
    until [ -s "runs/$name/metrics.jsonl" ] \
        && [ "$(grep -c '"kind":"step"' "runs/$name/metrics.jsonl")" -ge "$steps" ]; do
        sleep 1
    done
}
