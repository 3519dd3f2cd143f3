#!/usr/bin/env bash
# Remote loader actors against local loader threads: one CPU trainer on the head, whose
# CPUs it reserves, fed by W loader workers, either as threads in its own process
# (data.loaders = "local") or run by K loader actors that the head places on a second,
# CPU-only node (data.loaders = "remote"), their uint8 batches sent over data channels.
# The model is the small CNN (width 8) on one libtorch thread at SIZE px, so the loader
# is what limits images/s. Prints, side by side, images/s, images/s per loader worker
# and the trainer's data wait.
#
#   tools/loader_bench.sh [WORKERS...]        # default: 1 2
#
# Needs target/release/imgrun (`cargo build --release --bin imgrun`). DATA (default
# /tmp/imgrun-loader-bench) holds the shards, made once: JPEGs of 256 px from
# assets/photos/ (each photo many times over, 4 classes), else synthetic ones.
# SIZE (default 32) is the train crop, EPOCHS (default 3) the epochs per run; the first
# epoch is left out of the figures. Both nodes are daemons on this machine, so the
# cores they use are the same ones: this measures what placing the loaders in other
# processes and sending their batches costs, not what more cores would give.
#
# NETNS=1 puts the head (with the trainer and the `imgrun train` client) and the node in
# two network namespaces joined by a veth pair (needs root and `ip`), so batches cross a
# real link instead of loopback. PIN=1 pins the head's processes to CPU 0 and the node's
# to CPU 1 (taskset): the trainer's node then has one core, and the remote runs show
# what borrowing a CPU-only node's core gives.
set -euo pipefail

workers=("$@")
[ ${#workers[@]} -eq 0 ] && workers=(1 2)
size=${SIZE:-32}
epochs=${EPOCHS:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
imgrun=${IMGRUN:-$root/target/release/imgrun}
data=${DATA:-/tmp/imgrun-loader-bench}
photos=${PHOTOS:-$root/assets/photos}
work=$(mktemp -d)
export IMGRUN_CLUSTER__HEARTBEAT_MS=200 IMGRUN_CLUSTER__DEAD_AFTER_MS=3000

# How each side's commands run: in its namespace, on its core.
on_head=()
on_node=()
head_ip=127.0.0.1
node_ip=127.0.0.1
tag=$$
if [ "${NETNS:-0}" = 1 ]; then
    head_ip=10.78.0.1
    node_ip=10.78.0.2
    on_head=(ip netns exec "imgrun-bh-$tag")
    on_node=(ip netns exec "imgrun-bn-$tag")
fi
if [ "${PIN:-0}" = 1 ]; then
    on_head+=(taskset -c 0)
    on_node+=(taskset -c 1)
fi

stop() {
    IMGRUN_STATE_DIR=$work/node "${on_node[@]}" "$imgrun" stop >/dev/null 2>&1 || true
    IMGRUN_STATE_DIR=$work/head "${on_head[@]}" "$imgrun" stop >/dev/null 2>&1 || true
    if [ "${NETNS:-0}" = 1 ]; then
        ip netns del "imgrun-bh-$tag" 2>/dev/null || true
        ip netns del "imgrun-bn-$tag" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap stop EXIT

if [ "${NETNS:-0}" = 1 ]; then
    ip netns add "imgrun-bh-$tag"
    ip netns add "imgrun-bn-$tag"
    ip link add "imgbh$tag" netns "imgrun-bh-$tag" type veth peer name "imgbn$tag" \
        netns "imgrun-bn-$tag"
    ip -n "imgrun-bh-$tag" addr add "$head_ip/24" dev "imgbh$tag"
    ip -n "imgrun-bn-$tag" addr add "$node_ip/24" dev "imgbn$tag"
    for ns in "imgrun-bh-$tag" "imgrun-bn-$tag"; do
        ip -n "$ns" link set lo up
    done
    ip -n "imgrun-bh-$tag" link set "imgbh$tag" up
    ip -n "imgrun-bn-$tag" link set "imgbn$tag" up
fi

if [ ! -f "$data/train.spec" ]; then
    rm -rf "$data"
    mkdir -p "$data/src"
    if ls "$photos"/*.jpg "$photos"/*.png >/dev/null 2>&1; then
        echo "== making shards from $photos (JPEG, shorter side 256)"
        n=0
        for copy in $(seq 1 100); do
            for photo in "$photos"/*.jpg "$photos"/*.png; do
                class=$((n % 4))
                mkdir -p "$data/src/c$class"
                ln "$photo" "$data/src/c$class/$copy-$(basename "$photo")" 2>/dev/null ||
                    cp "$photo" "$data/src/c$class/$copy-$(basename "$photo")"
                n=$((n + 1))
            done
        done
        "$imgrun" shards create "$data/src" "$data/train" --resize 256 --maxcount 100 \
            --prefix train | tail -1 >/dev/null
        spec=$(ls "$data/train"/train-*.tar | sort | head -1)
        last=$(ls "$data/train"/train-*.tar | sort | tail -1)
        first=$(basename "$spec" .tar)
        echo "$data/train/train-{${first#train-}..$(basename "$last" .tar | sed 's/train-//')}.tar" \
            >"$data/train.spec"
    else
        echo "== no photos at $photos: synthetic shards"
        "$imgrun" shards synth "$data/train" --classes 4 --per-class 300 --size 256 \
            --maxcount 100 --seed 1 --prefix train | tail -1 >"$data/train.spec"
    fi
    rm -rf "$data/src"
fi
spec=$(cat "$data/train.spec")

cpus=$(( $(printf '%s\n' "${workers[@]}" | sort -n | tail -1) ))
join_line=$(IMGRUN_STATE_DIR=$work/head "${on_head[@]}" "$imgrun" start --head \
    --bind "$head_ip" --port 0 --num-gpus 0 --num-cpus 2 | grep -m1 '^ *imgrun join')
read -r _ _ address _ token _ ca_hash <<<"$join_line"
IMGRUN_STATE_DIR=$work/node "${on_node[@]}" "$imgrun" join "$address" --token "$token" \
    --ca-hash "$ca_hash" --bind "$node_ip" --num-gpus 0 --num-cpus "$cpus" >/dev/null

run() { # NAME LOADERS WORKERS ACTORS
    IMGRUN_STATE_DIR=$work/head "${on_head[@]}" "$imgrun" train --name "$1" --epochs "$epochs" \
        --no-plot \
        --set "data.train=\"$spec\"" --set 'data.val=""' --set 'data.mode="split"' \
        --set "data.loaders=\"$2\"" --set "data.loader_workers=$3" \
        --set "data.loader_actors=$4" --set "data.image_size=$size" \
        --set "data.eval_size=$size" --set 'model.name="small_cnn"' --set 'model.width=8' \
        --set 'train.batch_size=64' --set 'train.cpu_trainers=1' --set 'train.threads=1' \
        --set "train.runs_dir=\"$work/runs\"" --set 'train.eval_every_epochs=0' \
        --set 'train.checkpoint_every_epochs=0' >"$work/$1.log" 2>&1 ||
        { cat "$work/$1.log"; exit 1; }
    python3 - "$work/runs/$1/metrics.jsonl" "$1" "$3" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [r for r in records if r.get("kind") == "step"]
steady = [r for r in steps if r["epoch"] >= 1] or steps
images = sum(r["samples"] for r in steady)
seconds = sum(r["step_s"] for r in steady)
wait = sum(r["data_wait_s"] for r in steady)
workers = int(sys.argv[3])
print(f"{sys.argv[2]:<22} {images / seconds:9.1f} images/s  {images / seconds / workers:8.1f} "
      f"per worker  data wait {100 * wait / seconds:5.1f}%  ({len(steady)} steps)")
EOF
}

echo "== $spec, ${size} px crops, batch 64, small CNN; figures from epoch 1 on" \
    "(NETNS=${NETNS:-0}, PIN=${PIN:-0})"
for w in "${workers[@]}"; do
    run "local-w$w" local "$w" 0
    run "remote-w$w-k1" remote "$w" 1
    for k in 2 4; do
        if [ "$k" -le "$w" ]; then
            run "remote-w$w-k$k" remote "$w" "$k"
        fi
    done
done
