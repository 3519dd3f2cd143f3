#!/usr/bin/env bash
# AllReduce against decentralized training on a slow link: four CPU trainers, two on
# each of two nodes in network namespaces joined by a veth pair whose bandwidth tc's tbf
# limits (both directions). For each rate, the same job runs with train.sync =
# "allreduce", then "decentralized" with each topology given; prints images/s (from
# epoch 1 on), the time spent waiting for the average, the final validation top-1 and
# the replicas' spread at the last evaluation, side by side.
#
#   tools/sync_bench.sh [TOPOLOGY...]      # default: one-peer-exponential ring
#
# Needs root, `ip` and `tc`, and target/release/imgrun (`cargo build --release --bin
# imgrun`). RATES (default "1gbit 100mbit") are the link's rates; EPOCHS (default 6),
# PER_CLASS (default 500 training images per class, 10 classes), WIDTH (default 32: the
# small CNN's width, about 0.4 M parameters, 1.6 MB of gradients a step), SIZE (default
# 32 px) and BATCH (default 32 per rank) shape the job. DATA (default
# /tmp/imgrun-sync-bench) holds the synthetic shapes shards, made once. Both nodes share
# this machine's cores: the link is what differs between the runs.
set -euo pipefail

topologies=("$@")
[ ${#topologies[@]} -eq 0 ] && topologies=(one-peer-exponential ring)
read -r -a rates <<<"${RATES:-1gbit 100mbit}"
epochs=${EPOCHS:-6}
per_class=${PER_CLASS:-500}
width=${WIDTH:-32}
size=${SIZE:-32}
batch=${BATCH:-32}
root=$(cd "$(dirname "$0")/.." && pwd)
imgrun=${IMGRUN:-$root/target/release/imgrun}
data=${DATA:-/tmp/imgrun-sync-bench}
work=$(mktemp -d)
tag=$$
head_ns=imgrun-sh-$tag
node_ns=imgrun-sn-$tag
head_dev=imgsh$tag
node_dev=imgsn$tag
head_ip=10.79.0.1
node_ip=10.79.0.2
export IMGRUN_CLUSTER__HEARTBEAT_MS=200 IMGRUN_CLUSTER__DEAD_AFTER_MS=5000

[ "$(id -u)" = 0 ] || { echo "sync_bench.sh needs root (network namespaces, tc)" >&2; exit 2; }
[ -x "$imgrun" ] || { echo "no $imgrun: cargo build --release --bin imgrun" >&2; exit 2; }

stop() {
    IMGRUN_STATE_DIR=$work/node ip netns exec "$node_ns" "$imgrun" stop >/dev/null 2>&1 || true
    IMGRUN_STATE_DIR=$work/head ip netns exec "$head_ns" "$imgrun" stop >/dev/null 2>&1 || true
    ip netns del "$head_ns" 2>/dev/null || true
    ip netns del "$node_ns" 2>/dev/null || true
    rm -rf "$work"
}
trap stop EXIT

ip netns add "$head_ns"
ip netns add "$node_ns"
ip link add "$head_dev" netns "$head_ns" type veth peer name "$node_dev" netns "$node_ns"
ip -n "$head_ns" addr add "$head_ip/24" dev "$head_dev"
ip -n "$node_ns" addr add "$node_ip/24" dev "$node_dev"
for ns in "$head_ns" "$node_ns"; do ip -n "$ns" link set lo up; done
ip -n "$head_ns" link set "$head_dev" up
ip -n "$node_ns" link set "$node_dev" up

limit() { # RATE: the same token bucket on both ends of the link
    local burst=64kb
    case "$1" in *gbit) burst=512kb ;; esac
    tc -n "$head_ns" qdisc replace dev "$head_dev" root tbf rate "$1" burst "$burst" latency 50ms
    tc -n "$node_ns" qdisc replace dev "$node_dev" root tbf rate "$1" burst "$burst" latency 50ms
}

if [ ! -f "$data/train.spec" ]; then
    rm -rf "$data" && mkdir -p "$data"
    "$imgrun" shards synth "$data/train" --per-class "$per_class" --size 64 --maxcount 250 \
        --seed 1 --prefix train | tail -1 >"$data/train.spec"
    "$imgrun" shards synth "$data/val" --per-class 100 --size 64 --maxcount 250 --seed 2 \
        --prefix val | tail -1 >"$data/val.spec"
fi
train=$(cat "$data/train.spec")
val=$(cat "$data/val.spec")

join_line=$(IMGRUN_STATE_DIR=$work/head ip netns exec "$head_ns" "$imgrun" start --head \
    --bind "$head_ip" --port 0 --num-gpus 0 --num-cpus 2 | grep -m1 '^ *imgrun join')
read -r _ _ address _ token _ ca_hash <<<"$join_line"
IMGRUN_STATE_DIR=$work/node ip netns exec "$node_ns" "$imgrun" join "$address" --token "$token" \
    --ca-hash "$ca_hash" --bind "$node_ip" --num-gpus 0 --num-cpus 2 >/dev/null

run() { # NAME RATE SYNC TOPOLOGY
    IMGRUN_STATE_DIR=$work/head ip netns exec "$head_ns" "$imgrun" train --name "$1" \
        --epochs "$epochs" --no-plot \
        --set "data.train=\"$train\"" --set "data.val=\"$val\"" \
        --set 'data.loader_workers=1' --set "data.image_size=$size" --set "data.eval_size=$size" \
        --set 'data.resize_ratio=1.0' --set 'data.crop_scale=[1.0, 1.0]' --set 'data.flip=false' \
        --set 'model.name="small_cnn"' --set "model.width=$width" \
        --set "train.batch_size=$batch" --set 'train.lr=0.4' --set 'train.reference_batch=256' \
        --set 'train.warmup_epochs=0.5' --set 'train.label_smoothing=0.0' \
        --set 'train.weight_decay=0.0005' \
        --set "train.sync=\"$3\"" --set "train.topology=\"$4\"" \
        --set 'train.cpu_trainers=4' --set 'train.threads=1' \
        --set "train.runs_dir=\"$work/runs\"" --set 'train.checkpoint_every_epochs=0' \
        --set "train.eval_every_epochs=$epochs" >"$work/$1.log" 2>&1 ||
        { cat "$work/$1.log"; exit 1; }
    grep -q '2 node(s) x 2 rank(s)' "$work/$1.log" ||
        { echo "$1: not two ranks on each node:"; cat "$work/$1.log"; exit 1; }
    python3 - "$work/runs/$1/metrics.jsonl" "$2" "$3" "$4" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [r for r in records if r.get("kind") == "step"]
steady = [r for r in steps if r["epoch"] >= 1] or steps
images = sum(r["samples"] for r in steady)
seconds = sum(r["step_s"] for r in steady)
wait = sum(r["allreduce_s"] for r in steady)
evals = [r for r in records if r.get("kind") == "eval"]
top1 = evals[-1]["top1"] * 100 if evals else float("nan")
spread = evals[-1].get("replica_spread") if evals else None
sync = sys.argv[3] if sys.argv[3] == "allreduce" else sys.argv[4]
print(f"{sys.argv[2]:>8}  {sync:<21} {images / seconds:8.1f} images/s  "
      f"average wait {100 * wait / seconds:5.1f}%  top-1 {top1:6.2f}%  "
      f"spread {spread if spread is None else round(spread, 3)}  ({len(steady)} steps)")
EOF
}

echo "== $train; 4 CPU trainers (2 per node), small CNN width $width, ${size} px," \
    "batch $batch per rank, $epochs epochs; images/s from epoch 1 on"
for rate in "${rates[@]}"; do
    limit "$rate"
    run "allreduce-$rate" "$rate" allreduce one-peer-exponential
    for topology in "${topologies[@]}"; do
        run "$topology-$rate" "$rate" decentralized "$topology"
    done
done
