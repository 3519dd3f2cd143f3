#!/usr/bin/env bash
# Client CPU per GB and throughput reading shards from an S3 API on loopback (moto),
# imgrun's `s3://` source against `aws s3 cp`; see tools/s3_bench.py for what it runs.
#
#   tools/s3_bench.sh              # SHARDS=8 SHARD_MB=32 RUNS=3
#
# Uses IMGRUN (default target/release/imgrun: `cargo build --release --bin imgrun`) and
# the venv of tools/pytools.sh (moto and awscli).
set -euo pipefail
cd "$(dirname "$0")/.."
imgrun=${IMGRUN:-target/release/imgrun}
[ -x "$imgrun" ] || { echo "no $imgrun: cargo build --release --bin imgrun, or set IMGRUN" >&2; exit 2; }
python=$(bash tools/pytools.sh)
exec "$python" tools/s3_bench.py "$imgrun"
