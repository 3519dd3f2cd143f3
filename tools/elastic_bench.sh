#!/usr/bin/env bash
# Recovery of an elastic job (`train.elastic`) from the loss of a node: a head and two
# nodes on loopback, one CPU trainer on each. Mid-job, the second node's daemon is
# SIGKILLed (its trainer's process ends with it); prints the time from the SIGKILL to
# the first step the two survivors complete together, with the failure-detection window
# (cluster.dead_after_ms) of each WINDOWS entry, and the images/s of the epochs after
# the recovery beside those of a fresh job of the same two trainers.
#
#   IMGRUN=target/release/imgrun tools/elastic_bench.sh
#
# WINDOWS (default "3000 1000": the default window and a 1 s one, in ms), EPOCHS
# (default 6), KILL_AT (default 2: the epoch whose start the kill follows), PER_CLASS
# (default 250 training images per class, 10 classes), WIDTH (default 16), SIZE (default
# 32 px) and BATCH (default 32 per rank) shape the runs. DATA (default
# /tmp/imgrun-elastic-bench) holds the synthetic shards, made once.
set -euo pipefail

read -r -a windows <<<"${WINDOWS:-3000 1000}"
epochs=${EPOCHS:-6}
kill_at=${KILL_AT:-2}
per_class=${PER_CLASS:-250}
width=${WIDTH:-16}
size=${SIZE:-32}
batch=${BATCH:-32}
root=$(cd "$(dirname "$0")/.." && pwd)
imgrun=${IMGRUN:-$root/target/release/imgrun}
data=${DATA:-/tmp/imgrun-elastic-bench}
work=$(mktemp -d)
export IMGRUN_CLUSTER__HEARTBEAT_MS=200

[ -x "$imgrun" ] || { echo "no $imgrun: cargo build --release --bin imgrun" >&2; exit 2; }

machines=(head node2 node3)
stop_all() {
    for m in "${machines[@]}"; do
        IMGRUN_STATE_DIR=$work/$m "$imgrun" stop >/dev/null 2>&1 || true
    done
}
trap 'stop_all; rm -rf "$work"' EXIT

if [ ! -f "$data/train.spec" ]; then
    rm -rf "$data" && mkdir -p "$data"
    "$imgrun" shards synth "$data/train" --per-class "$per_class" --size 64 --maxcount 250 \
        --seed 1 --prefix train | tail -1 >"$data/train.spec"
    "$imgrun" shards synth "$data/val" --per-class 50 --size 64 --maxcount 250 --seed 2 \
        --prefix val | tail -1 >"$data/val.spec"
fi
train=$(cat "$data/train.spec")
val=$(cat "$data/val.spec")

cluster() { # WINDOW NODES: a head and NODES-1 joined nodes
    stop_all
    rm -rf "${work:?}"/head "$work"/node2 "$work"/node3
    export IMGRUN_CLUSTER__DEAD_AFTER_MS=$1
    local line address token ca_hash
    line=$(IMGRUN_STATE_DIR=$work/head "$imgrun" start --head --bind 127.0.0.1 --port 0 \
        --num-gpus 0 | grep -m1 '^ *imgrun join')
    read -r _ _ address _ token _ ca_hash <<<"$line"
    for m in $(seq 2 "$2"); do
        IMGRUN_STATE_DIR=$work/node$m "$imgrun" join "$address" --token "$token" \
            --ca-hash "$ca_hash" --bind 127.0.0.1 --num-gpus 0 >/dev/null
    done
}

job() { # NAME: starts the job in the background
    IMGRUN_STATE_DIR=$work/head "$imgrun" train --name "$1" --epochs "$epochs" --no-plot \
        --set "data.train=\"$train\"" --set "data.val=\"$val\"" --set 'data.mode="split"' \
        --set 'data.loader_workers=1' --set "data.image_size=$size" --set "data.eval_size=$size" \
        --set 'data.resize_ratio=1.0' --set 'data.crop_scale=[1.0, 1.0]' --set 'data.flip=false' \
        --set 'model.name="small_cnn"' --set "model.width=$width" \
        --set "train.batch_size=$batch" --set 'train.lr=0.2' --set 'train.reference_batch=64' \
        --set 'train.warmup_epochs=0.0' --set 'train.threads=1' \
        --set 'train.elastic=true' --set 'train.min_world=2' \
        --set "train.runs_dir=\"$work/runs\"" --set 'train.checkpoint_every_epochs=0' \
        --set "train.eval_every_epochs=$epochs" >"$work/$1.log" 2>&1 &
}

rate() { # METRICS FROM_EPOCH: images/s of the epochs from FROM_EPOCH on
    python3 - "$1" "$2" <<'EOF'
import json, sys
records = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
epochs = [r for r in records if r.get("kind") == "epoch" and r["epoch"] >= int(sys.argv[2])]
print(f"{sum(r['samples'] for r in epochs) / sum(r['seconds'] for r in epochs):.0f}")
EOF
}

echo "== 3 nodes on loopback, 1 CPU trainer each; small CNN width $width, ${size} px, batch" \
    "$batch per rank, $epochs epochs; the third node's daemon SIGKILLed at epoch $kill_at"
for window in "${windows[@]}"; do
    cluster "$window" 3
    name=kill-$window
    job "$name"
    metrics=$work/runs/$name/metrics.jsonl
    until grep -q "\"kind\":\"step\",\"epoch\":$kill_at," "$metrics" 2>/dev/null; do
        sleep 0.05
    done
    daemon=$(python3 -c "import json,glob; print(json.load(open(glob.glob('$work/node3/daemons/*')[0]))['pid'])")
    killed=$(date +%s.%N)
    kill -9 "$daemon"
    # The first call after a regroup is one step, written when every survivor ends it.
    until python3 - "$metrics" <<'EOF'
import json, sys
seen = False
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    seen = seen or r.get("kind") == "regroup"
    if seen and r.get("kind") == "step":
        sys.exit(0)
sys.exit(1)
EOF
    do sleep 0.005; done
    stepped=$(date +%s.%N)
    wait
    grep -q "elastic: lost rank" "$work/$name.log" || { cat "$work/$name.log"; exit 1; }
    [ -z "${LOGS:-}" ] || cp -r "$work/$name.log" "$work/head" "$LOGS/"
    after=$(rate "$metrics" $((kill_at + 1)))
    python3 - "$metrics" "$window" "$killed" "$stepped" "$after" <<'EOF'
import json, sys
records = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
regroup = next(r for r in records if r.get("kind") == "regroup")
took = float(sys.argv[4]) - float(sys.argv[3])
print(f"window {sys.argv[2]:>5} ms: SIGKILL to the first step of 2 ranks {took:5.2f} s "
      f"(the job: lost rank found {regroup.get('found_s', 0):.2f} s and ring re-formed "
      f"{regroup['recovery_s']:.2f} s after it saw the failure); "
      f"then {sys.argv[5]} images/s")
EOF
done
cluster 3000 2
job fresh
wait
echo "fresh job of 2 trainers: $(rate "$work/runs/fresh/metrics.jsonl" $((kill_at + 1))) images/s" \
    "(epochs $((kill_at + 1)) on)"
