"""torch.distributed gloo allreduce on loopback, every rank its own process: the gloo
column of `cargo run --release -p runtime --example allreduce_procs`, which runs it as

    $VIRTUAL_ENV/bin/python runtime/benches/python/allreduce_gloo.py --world 4 \
        [--max-bytes 268435456] [--target-bytes 268435456]

It mirrors the Rust ranks: the same float32 sizes (4 KiB to --max-bytes, powers of 4),
iteration counts, warm-up, statistics (the slowest rank's upper median and p99) and JSON
lines on stdout, one per size, from rank 0. Every rank calls torch.set_num_threads(1);
the TCP store and gloo's sockets are on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo).
"""

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time


def sizes(max_bytes):
    size = 4 << 10
    while size <= max_bytes:
        yield size
        size *= 4


def iterations(nbytes, target_bytes):
    """Timed and warm-up iterations, as `iterations` in allreduce_procs.rs."""
    iters = min(max(target_bytes // nbytes, 5), 1000)
    return iters, min(max(iters // 5, 1), 50)


def stats(times):
    times = sorted(times)
    n = len(times)
    p99 = times[min(max(math.ceil(n * 99 / 100), 1), n) - 1]
    return times[n // 2], p99, sum(times) / n


def rank_main(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world,
    )
    all_sizes = list(sizes(args.max_bytes))
    buffer = torch.zeros(max(all_sizes) // 4, dtype=torch.float32)
    for nbytes in all_sizes:
        data = buffer[: nbytes // 4]
        iters, warmup = iterations(nbytes, args.target_bytes)
        dist.barrier()
        for _ in range(warmup):
            dist.all_reduce(data)
        dist.barrier()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            dist.all_reduce(data)
            times.append(time.perf_counter() - start)
        # Check the sum once, then zero the buffer so values never grow.
        data.fill_(rank + 1.0)
        dist.all_reduce(data)
        want = world * (world + 1) / 2
        if data[0].item() != want or data[-1].item() != want:
            raise SystemExit(f"rank {rank}: wrong sum at {nbytes} bytes")
        data.zero_()

        worst = torch.tensor(stats(times), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            median, p99, mean = worst.tolist()
            algbw = nbytes / median / 1e9
            line = {
                "impl": "gloo",
                "world": world,
                "bytes": nbytes,
                "iters": iters,
                "median_us": median * 1e6,
                "p99_us": p99 * 1e6,
                "mean_us": mean * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (world - 1) / world,
                "torch_threads": torch.get_num_threads(),
            }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args):
    """Starts `--world` rank processes of this script; rank 0's stdout is ours."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    common = [
        "--world", str(args.world),
        "--port", str(free_port()),
        "--max-bytes", str(args.max_bytes),
        "--target-bytes", str(args.target_bytes),
    ]
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(rank)] + common,
            env=env,
            stdout=None if rank == 0 else subprocess.DEVNULL,
        )
        for rank in range(args.world)
    ]
    codes = [p.wait() for p in ranks]
    if any(codes):
        raise SystemExit(f"gloo ranks failed with exit codes {codes}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=None, help="internal: run one rank")
    parser.add_argument("--port", type=int, default=None, help="internal: the TCP store")
    parser.add_argument("--max-bytes", type=int, default=256 << 20)
    parser.add_argument("--target-bytes", type=int, default=256 << 20)
    args = parser.parse_args()
    if args.rank is None:
        launch(args)
    else:
        rank_main(args)


if __name__ == "__main__":
    main()
