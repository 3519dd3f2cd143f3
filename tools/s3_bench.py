"""Reading shards from an S3 API: imgrun's `s3://` source against `aws s3 cp`.

Starts moto's S3 server on loopback (the same server the tests use), puts SHARDS tar
shards of SHARD_MB megabytes in a bucket, then reads them all, several times each way,
and prints per way: wall seconds, MB/s, and the client's CPU seconds (user + system of
the client processes alone, from their rusage) per GB read. Then trains the small CNN on
the same shards from the bucket and from disk, and prints each epoch's images/s and data
wait.

- imgrun: `imgrun shards ls 's3://bench/*.tar'`: lists the bucket, then reads every
  shard through the tar reader in ranged GETs (the loader's own read path).
- aws pipe: `aws s3 cp s3://bench/NAME -` for each shard, to /dev/null: what Python
  webdataset users run as `pipe:aws s3 cp ... -`, one process per shard.
- aws recursive: one `aws s3 cp --recursive` of the whole prefix into a folder in
  /dev/shm (memory), its best case.

moto is Python and serves every byte, so it, not the client, caps the MB/s on this
machine; the CPU seconds per GB are the client's alone and are what the comparison is
about. Run by tools/s3_bench.sh, which finds the Python with moto and the binary.
"""

import io
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def write_shard(path, megabytes, seed):
    """A tar of 1 MB members of random bytes, in WebDataset's naming."""
    with tarfile.open(path, "w") as tar:
        for i in range(megabytes):
            data = os.urandom(1 << 20)
            info = tarfile.TarInfo(f"s{seed:03d}_{i:05d}.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def timed(label, commands, nbytes, results, env, runs):
    """Runs `commands` (one after another) `runs` times; keeps the best wall time and
    the CPU of that run."""
    best = None
    for _ in range(runs):
        cpu0, t0 = child_cpu(), time.monotonic()
        for command in commands:
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        wall, cpu = time.monotonic() - t0, child_cpu() - cpu0
        if best is None or wall < best[0]:
            best = (wall, cpu)
    wall, cpu = best
    gb = nbytes / 1e9
    results.append((label, wall, nbytes / 1e6 / wall, cpu / gb))
    print(f"  {label}: {wall:.2f} s, {nbytes / 1e6 / wall:.0f} MB/s, {cpu / gb:.2f} CPU-s per GB", flush=True)


def epoch_figures(run):
    """(images/s, data wait fraction) of each epoch record of a run."""
    figures = []
    with open(run / "metrics.jsonl") as records:
        for line in records:
            record = json.loads(line)
            if record.get("kind") == "epoch":
                figures.append((record["images_per_s"], record["data_wait_fraction"]))
    return figures


def train_from_both(imgrun, env, work):
    """The same training job from shards in the bucket and from the same shards on disk:
    `imgrun shards synth` writes them straight into the bucket and, with the same seed,
    into a folder; the small CNN trains TRAIN_EPOCHS epochs on each. Prints each epoch's
    images/s and the fraction of step time the trainer waited for data."""
    epochs = os.environ.get("TRAIN_EPOCHS", "3")
    synth = ["synth", "--classes", "10", "--per-class", "400", "--size", "64", "--maxcount", "500", "--seed", "3", "--prefix", "train"]
    subprocess.run([imgrun, "shards", synth[0], "s3://bench/train/", *synth[1:]], check=True, env=env, stdout=subprocess.DEVNULL)
    local = work / "train"
    subprocess.run([imgrun, "shards", synth[0], str(local), *synth[1:]], check=True, env=env, stdout=subprocess.DEVNULL)
    spec = "train-{000000..000007}.tar"
    print(f"training the small CNN {epochs} epochs on 4,000 64-px images, from the bucket and from disk:", flush=True)
    for label, train in [("s3://", f"s3://bench/train/{spec}"), ("disk", f"{local}/{spec}")]:
        sets = [
            f"data.train={json.dumps(train)}", "data.val=\"\"", f"train.runs_dir={json.dumps(str(work / 'runs'))}",
            "data.loader_workers=2", "data.image_size=64", "model.name=\"small_cnn\"", "model.width=16",
            "train.batch_size=64", "train.warmup_epochs=0.0",
        ]
        command = [imgrun, "train", "--name", label.strip(":/"), "--epochs", epochs, "--no-plot"]
        for item in sets:
            command += ["--set", item]
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        figures = epoch_figures(work / "runs" / label.strip(":/"))
        shown = ", ".join(f"epoch {i}: {ips:.0f} img/s, data wait {wait * 100:.1f}%" for i, (ips, wait) in enumerate(figures))
        print(f"  {label:6} {shown}", flush=True)


def main():
    imgrun = sys.argv[1]
    shards = int(os.environ.get("SHARDS", "8"))
    shard_mb = int(os.environ.get("SHARD_MB", "32"))
    runs = int(os.environ.get("RUNS", "3"))
    venv_bin = Path(sys.executable).parent
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="imgrun-s3-bench-"))
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_CONFIG_FILE=str(work / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(work / "none"),
    )
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError as error:
                if getattr(error, "code", None):
                    break
                time.sleep(0.1)
        aws = [str(venv_bin / "aws")]
        subprocess.run(aws + ["s3api", "create-bucket", "--bucket", "bench"], check=True, env=env, stdout=subprocess.DEVNULL)
        local = work / "shards"
        local.mkdir()
        for i in range(shards):
            write_shard(local / f"bench-{i:06d}.tar", shard_mb, i)
        subprocess.run(aws + ["s3", "cp", "--recursive", "--only-show-errors", str(local), "s3://bench/"], check=True, env=env)
        nbytes = sum(p.stat().st_size for p in local.iterdir())
        names = sorted(p.name for p in local.iterdir())
        print(f"{shards} shards of {shard_mb} MB ({nbytes / 1e6:.0f} MB) in moto at {endpoint}; best of {runs} runs each", flush=True)
        results = []
        timed("imgrun shards ls s3://", [[imgrun, "shards", "ls", "s3://bench/*.tar"]], nbytes, results, env, runs)
        pipes = [aws + ["s3", "cp", f"s3://bench/{name}", "-"] for name in names]
        timed("aws s3 cp NAME - (one per shard)", pipes, nbytes, results, env, runs)
        shm = Path(tempfile.mkdtemp(prefix="imgrun-s3-bench-", dir="/dev/shm"))
        try:
            recursive = [aws + ["s3", "cp", "--recursive", "--only-show-errors", "s3://bench/", str(shm)]]
            timed("aws s3 cp --recursive", recursive, nbytes, results, env, runs)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        ours = results[0][3]
        for label, _, _, cpu in results[1:]:
            print(f"imgrun uses {ours / cpu:.2f}x the CPU per GB of {label}")
        train_from_both(imgrun, env, work)
    finally:
        os.killpg(moto.pid, 9)
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
