# The two commands of the README. Both install what they need on first use.
.PHONY: demo test doctor bench

# Runs the main job on the embedded default dataset.
demo:
	eval "$$(bash tools/libtorch.sh)" && cargo run --locked --release -- demo

# Runs the whole test suite (format, dependency direction, clippy, tests).
test:
	bash tools/test.sh

doctor:
	eval "$$(bash tools/libtorch.sh)" && cargo run --locked --release -- doctor

bench:
	cargo bench --locked -p pipelines --bench read
