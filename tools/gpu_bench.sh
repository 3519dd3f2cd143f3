#!/usr/bin/env bash
# One trainer on one GPU: images/s of `imgrun train` on real shards against the same
# model, size, batch and precision on a fixed random batch (actors/examples/train_step.rs:
# no loader, and the trainer's on-device gradient average with nothing to communicate).
# The gap is the loader's share (and, with one rank, the synchronisation's). Also prints how gradients were averaged (NCCL or the
# ring) from the job's metrics.
#
#   tools/gpu_bench.sh [MODEL] [SIZE] [BATCH] [PRECISION]     # resnet50 224 128 amp
#
# Needs target/release/imgrun and target/release/examples/train_step (built on a machine
# with the Rust toolchain: `cargo build --release --bin imgrun --example train_step -p
# imgrun -p actors`) and a libtorch with CUDA on the loader path. DATA (default
# /tmp/imgrun-gpu-bench) holds the shards, made once: 100 classes x 100 JPEGs of 256 px.
# Without a GPU it runs on the CPU with the small CNN, to check the script itself:
#   tools/gpu_bench.sh small_cnn 48 32 fp32
set -euo pipefail

model=${1:-resnet50}
size=${2:-224}
batch=${3:-128}
precision=${4:-amp}
steps=${STEPS:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
imgrun=${IMGRUN:-$root/target/release/imgrun}
step_bin=${TRAIN_STEP:-$root/target/release/examples/train_step}
data=${DATA:-/tmp/imgrun-gpu-bench}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT

if [ "$model" = small_cnn ] || "$imgrun" doctor 2>/dev/null | grep -q '^cuda: *not available'; then
    device=cpu
    gpus=()
else
    device=cuda
    gpus=(--gpus 1)
fi

if [ ! -f "$data/train.spec" ]; then
    rm -rf "$data/train"
    mkdir -p "$data"
    "$imgrun" shards synth "$data/train" --classes 100 --per-class 100 --size 256 \
        --maxcount 1000 --seed 1 --prefix train | tail -1 >"$data/train.spec.partial"
    mv "$data/train.spec.partial" "$data/train.spec"
fi
spec=$(cat "$data/train.spec")

echo "== compute ceiling: $model ${size}px batch $batch $precision on $device, fixed random batch"
amp_flag=()
[ "$precision" = amp ] && amp_flag=(--amp)
"$step_bin" --device "$device" --model "$model" --size "$size" --batch "$batch" \
    --classes 100 --steps "$steps" "${amp_flag[@]}" | tee "$runs/ceiling.txt"
ceiling=$(tail -1 "$runs/ceiling.txt" | python3 -c 'import json,sys; print(json.load(sys.stdin)["images_per_s"])')

echo "== imgrun train: the same on real shards ($data/train)"
# Enough steps for a steady state: the epoch is the whole set, twice.
"$imgrun" train --embedded "${gpus[@]}" --name bench --epochs 2 --no-plot \
    --set "data.train=\"$spec\"" --set 'data.val=""' \
    --set "data.image_size=$size" --set "data.eval_size=$size" \
    --set "model.name=\"$model\"" --set "train.batch_size=$batch" \
    --set "train.precision=\"$precision\"" --set "train.runs_dir=\"$runs\"" \
    --set 'train.eval_every_epochs=0' --set 'train.checkpoint_every_epochs=0' \
    | tail -8
python3 - "$runs/bench/metrics.jsonl" "$ceiling" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
ceiling = float(sys.argv[2])
connect = next((r for r in records if r.get("kind") == "connect"), {})
steps = [r for r in records if r.get("kind") == "step"]
steady = [r for r in steps if r["epoch"] >= 1] or steps
images = sum(r["samples"] for r in steady)
seconds = sum(r["step_s"] for r in steady)
wait = sum(r["data_wait_s"] for r in steady)
sync = sum(r["allreduce_s"] for r in steady)
real = images / seconds
print(f"gradients averaged with: {connect.get('allreduce', '?')}")
print(f"real shards  {real:9.1f} images/s (steady: epoch 1 on, {len(steady)} steps), "
      f"data wait {100 * wait / seconds:.1f}%, gradient sync {1e3 * sync / len(steady):.1f} ms/step")
print(f"random batch {ceiling:9.1f} images/s")
print(f"real / random = {real / ceiling:.3f}  (loader's and sync's share of the gap: "
      f"{100 * (1 - real / ceiling):.1f}%)")
EOF
