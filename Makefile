# The two commands of the README. Both install what they need on first use, after
# tools/preflight.sh has checked the toolchain (Rust at the workspace's rust-version, a
# C and a C++ compiler, python3 with venv) and named whatever is missing.
.PHONY: demo test install doctor bench bench-gpu bench-dashboard gpu-kit preflight

preflight:
	@bash tools/preflight.sh

# Runs the main job on the embedded default dataset; the binary is target/release/imgrun.
# `make test` ends with `make demo DEMO_PROFILE=dev`: the same job, from the build its tests
# already made (target/debug/imgrun), rather than a second, optimised build of it all.
DEMO_PROFILE ?= release
demo: preflight
	eval "$$(bash tools/libtorch.sh)" && cargo run --locked --profile $(DEMO_PROFILE) -- demo

# Runs the whole test suite (format, dependency direction, clippy, tests).
test: preflight
	bash tools/test.sh

# Puts `imgrun` on PATH (~/.cargo/bin, or $$CARGO_INSTALL_ROOT/bin), linked against the
# cached libtorch: it carries an rpath to that folder, which must stay where it is.
install: preflight
	eval "$$(bash tools/libtorch.sh)" && cargo install --locked --path .

doctor: preflight
	eval "$$(bash tools/libtorch.sh)" && cargo run --locked --release -- doctor

# Benchmarks print figures and ratios: raw shard reading against cat and Python
# webdataset; decoding and the train transform against PIL, torchvision and DataLoader.
# The torch venv is made first (once): torchvision for the Python side runs on it. Then
# the control plane: actor messages, QUIC round trips, joins, heartbeats of 1,000 nodes,
# remote actor calls. Then the ring allreduce against torch.distributed with gloo (2 and 4
# processes, 4 KB to 256 MB), and training throughput against PyTorch DDP.
bench: preflight
	bash tools/libtorch.sh > /dev/null
	cargo bench --locked -p pipelines --bench read
	cargo bench --locked -p pipelines --bench loader
	cargo bench --locked -p runtime --bench cluster
	eval "$$(bash tools/libtorch.sh)" && cargo bench --locked -p actors --bench joblog
	eval "$$(bash tools/libtorch.sh)" && env -u LIBTORCH -u LIBTORCH_USE_PYTORCH cargo run --locked --release -p runtime --example allreduce_procs
	eval "$$(bash tools/libtorch.sh)" && cargo build --locked --release --bin imgrun && PY=$${IMGRUN_CACHE:-$$HOME/.cache/imgrun}/torch-2.11.0/bin/python && { $$PY -c 'import webdataset, PIL' 2>/dev/null || $$PY -m pip install --quiet webdataset pillow; } && $$PY actors/benches/python/compare_train.py --epochs 3 --repeat 2

# The head's dashboard under a running job (tools/bench_dashboard.sh): first load,
# step-to-page delay, the head's CPU and memory with and without pages following the job.
bench-dashboard: preflight
	eval "$$(bash tools/libtorch.sh)" && cargo build --locked --release --bin imgrun && bash tools/pytools.sh >/dev/null && bash tools/bench_dashboard.sh 20 5

# The device check (tools/gpu_check.sh): on a machine with a GPU, every stage a first
# contact should show (preflight, compute ceiling in fp32/amp/bf16, ResNet-50 on real
# shards against a random batch, NCCL between two processes, channels-last, the demo on
# CUDA), one PASS or FAIL line each. On a machine with a GPU and no Rust, carry
# target/gpu-kit/ and run its gpu_check.sh there.
bench-gpu: gpu-kit
	bash tools/gpu_check.sh

# The two binaries the device check runs, optimised and stripped, and the check itself, in
# target/gpu-kit/: small enough to carry to a machine without Rust (README, "On a machine
# with a GPU and no Rust").
gpu-kit: preflight
	eval "$$(bash tools/libtorch.sh)" && cargo build --locked --release -p imgrun -p actors --bin imgrun --example train_step
	mkdir -p target/gpu-kit
	strip -o target/gpu-kit/imgrun target/release/imgrun
	strip -o target/gpu-kit/train_step target/release/examples/train_step
	cp tools/gpu_check.sh target/gpu-kit/
	du -sh target/gpu-kit
