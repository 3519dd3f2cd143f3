#!/usr/bin/env bash
# The device check: everything a first contact with a GPU should show, in one command that
# runs from a carried folder of stripped binaries (`make gpu-kit`) on a machine with a GPU,
# torch 2.11.0 and no Rust. Each stage runs under its own time limit and prints one line,
# `PASS stage figures` or `FAIL stage why`; the lines also go to $OUT/summary.txt, each
# stage's figures to $OUT/STAGE.json and every log, packed, to $OUT/logs.tar.gz.
#
#   tools/gpu_check.sh [--dry] [STAGE ...]      # every stage, or the ones named, in order
#
# Stages (limits in seconds; about 6 minutes in all on one H100/H200):
#   preflight      nvidia-smi, ldd of both binaries, `imgrun doctor` in full        30
#   ceiling        ResNet-50 on a fixed random batch: fp32, amp (fp16), bf16        75
#   real           ResNet-50 amp on real shards against the same on a random batch:
#                  NCCL ran, the loss scale, a falling loss, identical replicas     100
#   nccl           two processes on the one GPU: through NCCL with NCCL_HOSTID set,
#                  then without it, falling back to imgrun's ring with the reason    75
#   channels_last  ResNet-50 amp on a random batch, channels-last on against off     45
#   demo           `imgrun demo` on CUDA: its accuracy bar, images/s                  90
#
# --dry runs every stage on the CPU with the small CNN and small sizes (what `make test`
# runs, to test this script): no stage needs a GPU there, and NCCL stages expect the ring.
#
# Environment:
#   KIT        the carried folder with `imgrun` and `train_step`: by default this script's
#              own folder when they are beside it (the kit's copy), else target/gpu-kit
#   IMGRUN, TRAIN_STEP   the two binaries, if not in KIT
#   OUT        where results go (default ./gpu-check)
#   DATA       the shards, made once and kept (default /tmp/imgrun-gpu-check)
#   TORCH_LIB  the device's torch/lib; default: found through python3's torch. It is
#              *prepended* to LD_LIBRARY_PATH: the binaries' RUNPATH names the builder's
#              folder, and overwriting the path could hide the driver's libcuda.so.1 and
#              libnvidia-ml.so.1.

# The stages are called by name (`stage_$stage`); WORK and CORES come from $OUT/.env.
# shellcheck disable=SC2317,SC2153
set -uo pipefail

self=$(realpath "$0")
here=$(dirname "$self")
root=$(dirname "$here")
all_stages=(preflight ceiling real nccl channels_last demo)

# The inner call: one stage, under the outer call's time limit, output to its log.
if [ "${1:-}" = --inner ]; then
    stage=$2
    # shellcheck source=/dev/null
    source "$OUT/.env"
else
    dry=0
    stages=()
    for arg in "$@"; do
        case $arg in
        --dry) dry=1 ;;
        -h | --help)
            sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            if [[ " ${all_stages[*]} " != *" $arg "* ]]; then
                echo "gpu_check: unknown stage \`$arg\`; the stages: ${all_stages[*]}" >&2
                exit 2
            fi
            stages+=("$arg")
            ;;
        esac
    done
    [ ${#stages[@]} -gt 0 ] || stages=("${all_stages[@]}")
fi

# ---- set-up (the outer call) -------------------------------------------------------------

setup() {
    # The kit holds a copy of this script: run from there, it is its own folder.
    if [ -z "${KIT:-}" ] && [ -x "$here/imgrun" ]; then KIT=$here; fi
    KIT=${KIT:-$root/target/gpu-kit}
    IMGRUN=$(realpath -m "${IMGRUN:-$KIT/imgrun}")
    TRAIN_STEP=$(realpath -m "${TRAIN_STEP:-$KIT/train_step}")
    OUT=$(realpath -m "${OUT:-gpu-check}")
    DATA=$(realpath -m "${DATA:-/tmp/imgrun-gpu-check}")
    for bin in "$IMGRUN" "$TRAIN_STEP"; do
        if [ ! -x "$bin" ]; then
            echo "gpu_check: $bin is missing: build the kit with \`make gpu-kit\` (or set KIT," \
                "or IMGRUN and TRAIN_STEP)" >&2
            exit 2
        fi
    done
    if [ -z "${TORCH_LIB:-}" ] && command -v python3 >/dev/null; then
        TORCH_LIB=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null || true)
    fi
    if [ -n "${TORCH_LIB:-}" ]; then
        LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    mkdir -p "$OUT/logs" "$DATA"
    work=$(mktemp -d "${TMPDIR:-/tmp}/imgrun-gpu-check.XXXXXX")
    cores=$(nproc)
    {
        printf 'export %s=%q\n' IMGRUN "$IMGRUN" TRAIN_STEP "$TRAIN_STEP" OUT "$OUT" \
            DATA "$DATA" WORK "$work" DRY "$dry" CORES "$cores" \
            LD_LIBRARY_PATH "${LD_LIBRARY_PATH:-}" TORCH_LIB "${TORCH_LIB:-}"
    } >"$OUT/.env"
}

limit_of() {
    case $1 in
    preflight) echo 30 ;;
    ceiling) echo 75 ;;
    real) echo 100 ;;
    nccl) echo 75 ;;
    channels_last) echo 45 ;;
    demo) echo 90 ;;
    esac
}

# ---- helpers (the inner call) ------------------------------------------------------------

# Prints why and ends the stage as failed.
fail() {
    echo "FAIL: $*" >&2
    echo "$*" >"$OUT/.why"
    exit 1
}

# Records the stage's figures: a JSON object, and the one-line summary.
figures() {
    python3 -c 'import json, sys; json.loads(sys.argv[1])' "$1" 2>/dev/null ||
        fail "the stage's figures are not JSON: $1"
    printf '%s\n' "$1" >"$OUT/$stage.json"
    printf '%s\n' "$2" >"$OUT/.figure"
}

# The model, size and batch of the ResNet-50 stages, or the small CNN's in a dry run.
if [ "${DRY:-0}" = 1 ]; then
    model=small_cnn size=48 batch=32 steps=8 device=cpu
else
    model=resnet50 size=224 batch=128 steps=40 device=cuda
fi

# The compute ceiling of one configuration (train_step's JSON line): images/s.
ceiling() {
    local log=$WORK/ceiling-$1-$2.txt
    local layout=--channels-last
    [ "$2" = nchw ] && layout=--no-channels-last
    "$TRAIN_STEP" --device "$device" --model "$model" --size "$size" --batch "$batch" \
        --classes 100 --steps "$steps" --precision "$1" "$layout" | tee "$log" >&2 ||
        fail "train_step $1 $2 failed (log: logs/$stage.log)"
    tail -1 "$log" | python3 -c 'import json, sys; print(round(json.load(sys.stdin)["images_per_s"], 1))'
}

# Shards for the `real` and `nccl` stages, made once: 100 classes of 256 px JPEGs.
shards() {
    local per_class=100
    [ "$DRY" = 1 ] && per_class=4
    local dir=$DATA/train-$per_class
    # A spec written where the folder was before it moved (a copied target folder) names
    # shards that are not there: made again.
    if [ ! -f "$dir.spec" ] || [[ $(cat "$dir.spec") != "$dir/"* ]]; then
        rm -rf "$dir"
        "$IMGRUN" shards synth "$dir" --classes 100 --per-class "$per_class" --size 256 \
            --maxcount 500 --seed 1 --prefix train | tail -1 >"$dir.spec.partial" ||
            fail "imgrun shards synth failed"
        mv "$dir.spec.partial" "$dir.spec"
    fi
    cat "$dir.spec"
}

# What a job's metrics.jsonl says: the allreduce, steps, loss scale, first and last loss.
job_figures() {
    python3 - "$1" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
connect = next((r for r in records if r.get("kind") == "connect"), {})
steps = [r for r in records if r.get("kind") == "step"]
steady = [r for r in steps if r["epoch"] >= 1] or steps
seconds = sum(r["step_s"] for r in steady) or float("nan")
head, tail = steps[:5], steps[-5:]
mean = lambda rs: sum(r["loss"] for r in rs) / max(len(rs), 1)
print(json.dumps({
    "allreduce": connect.get("allreduce", "?"),
    "steps": len(steps),
    "images_per_s": round(sum(r["samples"] for r in steady) / seconds, 1),
    "data_wait_share": round(sum(r["data_wait_s"] for r in steady) / seconds, 3),
    "allreduce_ms": round(1e3 * sum(r["allreduce_s"] for r in steady) / max(len(steady), 1), 2),
    "loss_scale": next((r.get("loss_scale") for r in reversed(steps) if r.get("loss_scale")), None),
    "first_loss": round(mean(head), 4),
    "last_loss": round(mean(tail), 4),
}))
EOF
}

field() {
    python3 -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2" ||
        fail "no $2 in $1"
}

# ---- the stages --------------------------------------------------------------------------

stage_preflight() {
    local gpu="none (dry run)"
    if [ "$DRY" = 0 ]; then
        nvidia-smi || fail "nvidia-smi failed: no driver or no GPU"
        gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
    fi
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    for bin in "$IMGRUN" "$TRAIN_STEP"; do
        ldd "$bin" | tee "$WORK/ldd.txt"
        if grep -q 'not found' "$WORK/ldd.txt"; then
            fail "$(basename "$bin") lacks $(grep 'not found' "$WORK/ldd.txt" | awk '{print $1}' | paste -sd, -): set TORCH_LIB to the device torch's torch/lib"
        fi
    done
    "$IMGRUN" doctor | tee "$WORK/doctor.txt" || fail "imgrun doctor failed (log: logs/preflight.log)"
    local cuda torch nccl
    cuda=$(sed -n 's/^cuda: *//p' "$WORK/doctor.txt")
    torch=$(sed -n 's/^libtorch: *//p' "$WORK/doctor.txt")
    nccl=$(sed -n 's/^nccl: *//p' "$WORK/doctor.txt")
    if [ "$DRY" = 0 ] && [[ $cuda != available* ]]; then
        fail "imgrun doctor: cuda $cuda"
    fi
    figures "$(python3 -c 'import json, sys; print(json.dumps(dict(zip(("gpu", "cuda", "libtorch", "nccl"), sys.argv[1:]))))' "$gpu" "$cuda" "$torch" "$nccl")" \
        "gpu: $gpu; cuda: $cuda; libtorch: $torch; nccl: $nccl"
}

stage_ceiling() {
    local fp32 amp bf16
    fp32=$(ceiling fp32 nhwc) || exit 1
    amp=$(ceiling amp nhwc) || exit 1
    bf16=$(ceiling bf16 nhwc) || exit 1
    figures "{\"model\": \"$model\", \"size\": $size, \"batch\": $batch, \"fp32\": $fp32, \"amp\": $amp, \"bf16\": $bf16}" \
        "$model ${size}px batch $batch on $device: fp32 $fp32, amp $amp ($(ratio "$amp" "$fp32")x), bf16 $bf16 ($(ratio "$bf16" "$fp32")x) images/s"
}

ratio() {
    python3 -c 'import sys; a, b = map(float, sys.argv[1:]); print(f"{a / b:.2f}" if b else "nan")' "$1" "$2"
}

stage_real() {
    local spec random gpus=(--gpus 1) workers=$((CORES > 3 ? CORES - 2 : 1))
    spec=$(shards) || exit 1
    random=$(ceiling amp nhwc) || exit 1
    [ "$DRY" = 1 ] && gpus=(--cpu-trainers 1)
    # Two epochs of the whole set; epoch 1 on is the steady state.
    "$IMGRUN" train --embedded "${gpus[@]}" --name real --epochs 2 --no-plot \
        --set "data.train=\"$spec\"" --set 'data.val=""' \
        --set "data.image_size=$size" --set "data.eval_size=$size" \
        --set "data.loader_workers=$workers" \
        --set "model.name=\"$model\"" --set "train.batch_size=$batch" \
        --set 'train.precision="amp"' --set "train.runs_dir=\"$WORK/runs\"" \
        --set 'train.eval_every_epochs=0' --set 'train.checkpoint_every_epochs=0' \
        | tee "$WORK/real.txt" || fail "imgrun train failed (log: logs/real.log)"
    grep -q '^replicas: identical' "$WORK/real.txt" || fail "no 'replicas: identical' line"
    local job
    job=$(job_figures "$WORK/runs/real/metrics.jsonl") || fail "cannot read metrics.jsonl"
    local allreduce real scale first last
    allreduce=$(field "$job" allreduce) || exit 1
    real=$(field "$job" images_per_s) || exit 1
    scale=$(field "$job" loss_scale) || exit 1
    first=$(field "$job" first_loss) || exit 1
    last=$(field "$job" last_loss) || exit 1
    figures "{\"job\": $job, \"random_images_per_s\": $random, \"loader_workers\": $workers}" \
        "real $real against random $random images/s ($(ratio "$real" "$random")x); allreduce: $allreduce; loss scale $scale; loss $first -> $last"
    if [ "$DRY" = 0 ]; then
        [[ $allreduce == NCCL* ]] || fail "gradients went through $allreduce, not NCCL"
        [ "$scale" != None ] || fail "amp on CUDA wrote no loss scale"
    fi
    python3 -c 'import sys; sys.exit(float(sys.argv[2]) >= float(sys.argv[1]))' "$first" "$last" ||
        fail "the loss did not fall: $first -> $last"
}

# Two processes on the one GPU, as torchrun starts them; $1: with or without NCCL_HOSTID.
two_processes() {
    local name=$1 spec=$2 port=$3 rank pids=() epoch_size=2048
    [ "$DRY" = 1 ] && epoch_size=256
    for rank in 0 1; do
        (
            [ "$name" = hostid ] && export NCCL_HOSTID="imgrun-check-$rank"
            cd "$WORK" &&
                RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 \
                    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port TORCHELASTIC_RUN_ID=$name \
                    "$IMGRUN" train --name "nccl-$name" --epochs 1 --no-plot \
                    --set "data.train=\"$spec\"" --set 'data.val=""' \
                    --set 'data.image_size=64' --set 'data.eval_size=64' \
                    --set 'model.name="resnet18"' --set 'train.batch_size=32' \
                    --set "data.epoch_size=$epoch_size" \
                    --set 'train.checkpoint_every_epochs=0' --set 'train.eval_every_epochs=0' \
                    --set 'train.runs_dir="runs"' >"$WORK/nccl-$name-$rank.txt" 2>&1
        ) &
        pids+=($!)
    done
    local failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    cat "$WORK/nccl-$name-0.txt" "$WORK/nccl-$name-1.txt" >&2
    [ "$failed" = 0 ] || fail "the two processes ($name) failed (log: logs/nccl.log)"
    grep -q '^replicas: identical' "$WORK/nccl-$name-0.txt" || fail "$name: no 'replicas: identical' line"
    job_figures "$WORK/runs/nccl-$name/metrics.jsonl"
}

stage_nccl() {
    local spec hostid plain
    spec=$(shards) || exit 1
    hostid=$(two_processes hostid "$spec" 29611) || exit 1
    plain=$(two_processes plain "$spec" 29612) || exit 1
    local with without
    with=$(field "$hostid" allreduce) || exit 1
    without=$(field "$plain" allreduce) || exit 1
    figures "{\"with_hostid\": $hostid, \"without\": $plain}" \
        "with NCCL_HOSTID: $with, $(field "$hostid" allreduce_ms) ms/step; without: $without"
    if [ "$DRY" = 0 ]; then
        [[ $with == NCCL* ]] || fail "with NCCL_HOSTID set, gradients went through $with"
        [[ $without == *ring\ \(* ]] || fail "without NCCL_HOSTID, expected the ring with a reason: $without"
    fi
}

stage_channels_last() {
    local on off precision=amp
    on=$(ceiling "$precision" nhwc) || exit 1
    off=$(ceiling "$precision" nchw) || exit 1
    figures "{\"model\": \"$model\", \"precision\": \"$precision\", \"channels_last\": $on, \"nchw\": $off}" \
        "$model $precision: channels-last $on, NCHW $off images/s ($(ratio "$on" "$off")x)"
}

stage_demo() {
    local args=()
    [ "$DRY" = 1 ] && args=(--per-class 60 --val-per-class 20 --goal 0 --set train.epochs=1)
    (cd "$WORK" && "$IMGRUN" demo --out demo "${args[@]}") | tee "$WORK/demo.txt" ||
        fail "imgrun demo failed (log: logs/demo.log)"
    local done_line trainers
    done_line=$(grep '^done in' "$WORK/demo.txt" | tail -1)
    trainers=$(sed -n 's/^== 2\/2 training the small CNN on an embedded cluster with //p' "$WORK/demo.txt")
    figures "$(python3 -c 'import json, sys; print(json.dumps({"trainers": sys.argv[1], "result": sys.argv[2]}))' "$trainers" "$done_line")" \
        "$trainers: $done_line"
}

if [ "${1:-}" = --inner ]; then
    "stage_$stage"
    exit 0
fi

# ---- the outer call: each stage under its limit ------------------------------------------

setup
summary=$OUT/summary.txt
[ ${#stages[@]} = ${#all_stages[@]} ] && : >"$summary"
failed=0
started=$SECONDS
for stage in "${stages[@]}"; do
    limit=$(limit_of "$stage")
    [ "$dry" = 1 ] && limit=$((limit * 4))
    rm -f "$OUT/.why" "$OUT/.figure"
    begun=$SECONDS
    timeout -k 10 "$limit" bash "$self" --inner "$stage" >"$OUT/logs/$stage.log" 2>&1
    status=$?
    took=$((SECONDS - begun))
    if [ $status = 0 ] && [ -f "$OUT/.figure" ]; then
        line="PASS $stage ${took}s $(cat "$OUT/.figure")"
    else
        failed=1
        if [ $status = 124 ] || [ $status = 137 ]; then
            why="over its ${limit} s limit"
        elif [ -f "$OUT/.why" ]; then
            why=$(cat "$OUT/.why")
        else
            why="exit $status: $(tail -1 "$OUT/logs/$stage.log")"
        fi
        line="FAIL $stage ${took}s $why"
    fi
    echo "$line"
    echo "$line" >>"$summary"
done
echo "total $((SECONDS - started))s$([ "$dry" = 1 ] && echo ' (dry run, on the CPU)')" | tee -a "$summary"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs" "$OUT/.env" "$OUT/.why" "$OUT/.figure"
rm -rf "$work"
exit $failed
