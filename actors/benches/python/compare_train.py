"""Side-by-side training throughput: `imgrun train` against the PyTorch DDP reference.

One run on this machine, with the same job on both sides: the small CNN of
examples/demo.toml (width 16, 48 px, batch 64 per rank, lr 0.4 per 256, cosine, 0.5
warm-up epochs), 2 CPU trainers / DDP ranks (gloo), 1 libtorch thread and 1 loader worker
each, the same synthetic WebDataset shards. Each repeat runs, in an order that alternates
between repeats so that machine noise shows:

  * imgrun   `imgrun train --embedded --cpu-trainers 2` (metrics.jsonl read back)
  * ddp      actors/benches/python/ddp_train.py, real shards (webdataset + Pillow loader)
  * ddp-syn  ddp_train.py --synthetic: a fixed random batch, no loader, no eval
             (compute + gradient all-reduce only: the ceiling for this model on 2 ranks)

then prints one table: images/s (all epochs, and steady state = without the first
epoch), data-wait fraction, all-reduce time per step (imgrun only: PyTorch DDP overlaps
it with backward and does not report it), step time, final val top-1, training and wall
seconds, the 1-minute load average before and after each run, and the imgrun/PyTorch
ratios (mean over repeats).

Data: made once with `imgrun shards synth` and reused (the folder name holds the
parameters): train 10 classes x 1000, 64 px, --maxcount 250 --seed 1 --prefix demo-train;
val 10 x 200, --seed 2 --prefix demo-val.

Settings taken from examples/demo.toml and passed to ddp_train.py: width, image_size,
batch_size, lr/reference_batch, weight_decay, label_smoothing, warmup_epochs,
warmup_start_fraction (ddp --warmup-start-fraction), momentum 0.9 without Nesterov,
mode resampled (ddp --resampled), shuffle buffer 1000 (ddp's is fixed at 1000),
queue_batches (ddp --prefetch), crop_scale [1, 1] + flip false (ddp --no-augment: plain
resize), eval_size = image_size with resize_ratio 1 (ddp --eval-mode resize), eval every
epoch, and imgrun's weight init (ddp --init tch). Mismatches that stay: see MISMATCHES
below (printed with the table).

Optional profile (`--perf SECONDS`): during the first imgrun run, after --perf-delay
seconds, `perf record` samples one `imgrun worker` trainer process and the top symbols
are printed grouped (libtorch conv/gemm, JPEG decode, resize, all-reduce/network, copies,
allocator, kernel, ...).

`--model resnet18 --image-size 64` runs ResNet-18 at 64 px on both sides instead (the
shards are 64 px; one epoch takes minutes on 2 cores, so use --epochs 2 and
--no-synthetic or --repeat 1). The table's fwd+bwd column is imgrun's forward and
backward time per step (metrics.jsonl's compute_s); allred is its wait for the average.

Command (4 to 8 minutes on 2 shared cores with these settings; `make bench` runs it):

    /root/.cache/imgrun/torch-2.11.0/bin/python actors/benches/python/compare_train.py \\
        --epochs 3 --repeat 2

Needs target/release/imgrun (cargo build --release --bin imgrun) and the torch venv with
webdataset and Pillow (see ddp_train.py). `--json FILE` writes every run's figures.
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
DDP = os.path.join(HERE, "ddp_train.py")

MISMATCHES = [
    "random streams differ (weight init draws, shard order, shuffle buffer, resampling), "
    "so val top-1 agrees only statistically; both use plain per-rank BatchNorm with rank 0's "
    "buffers broadcast (imgrun after each step, DDP before each forward)",
    "resize: imgrun's own bilinear resize vs Pillow BILINEAR (antialiased) - moot here since "
    "crop_scale [1,1] and 64 -> 48 px on both sides; the 'random' crop at scale 1 is the whole "
    "image except in the rare draw where the aspect rounds to 1",
    "JPEG decode: imgrun's Rust decoder vs Pillow/libjpeg (both decode the same 64 px files)",
    "loader: imgrun 1 loader worker thread per rank inside the trainer process "
    "(queue_batches deep) vs one DataLoader worker *process* per rank (prefetch = "
    "queue_batches), so the PyTorch side has 4 busy processes on 2 cores",
    "all-reduce: imgrun averages 25 MB buckets after backward (with train.overlap=true, "
    "e.g. --imgrun-set, during backward in the order gradients come); DDP buckets 25 MB after "
    "a 1 MB first bucket and overlaps with backward; imgrun records its wait (allred), DDP "
    "none; imgrun also broadcasts the BN buffers after each step",
    "timing: imgrun's epoch time is the driver's wall time of its train calls (RPC round trips "
    "included, ~1 s chunks); ddp's is the slowest rank's sum of step times",
    "steps/epoch: both floor(10000 / 128) = 78; ddp-syn uses 100 steps/epoch",
]


# ------------------------------------------------------------------------------ helpers


def load():
    return os.getloadavg()


def fmt_load(la):
    return "/".join(f"{x:.2f}" for x in la)


def read_toml(path):
    import tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def make_shards(imgrun, out, per_class, seed, prefix, classes=10, size=64, maxcount=250):
    """Shards in a folder named by the parameters; reused when its .done marker exists."""
    folder = os.path.join(out, f"{prefix}-c{classes}-n{per_class}-s{size}-m{maxcount}-seed{seed}")
    done = os.path.join(folder, ".done")
    if os.path.exists(done):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [imgrun, "shards", "synth", folder, "--classes", str(classes), "--per-class",
           str(per_class), "--size", str(size), "--seed", str(seed), "--prefix", prefix,
           "--maxcount", str(maxcount)]
    print("# making shards:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(done, "w") as f:
        f.write(" ".join(cmd) + "\n")
    return folder


def brace_spec(folder, prefix):
    """`folder/prefix-{000000..000039}.tar` from the shards present."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, f"{prefix}-*.tar")))
    if not names:
        raise SystemExit(f"no {prefix}-*.tar in {folder}")
    nums = [re.match(rf"{re.escape(prefix)}-(\d+)\.tar$", n).group(1) for n in names]
    ints = sorted(int(n) for n in nums)
    if ints != list(range(ints[0], ints[0] + len(ints))):
        raise SystemExit(f"shards in {folder} are not numbered contiguously")
    width = len(nums[0])
    return os.path.join(folder, f"{prefix}-{{{ints[0]:0{width}d}..{ints[-1]:0{width}d}}}.tar"), len(ints)


def steady(values):
    """Rate over epochs of equal image counts: images / sum(seconds) = harmonic mean."""
    vals = [v for v in values if v]
    if not vals:
        return None
    return len(vals) / sum(1.0 / v for v in vals)


def time_weighted(fracs, rates):
    """Data-wait fraction over epochs: sum(frac * t) / sum(t), t ~ 1/rate."""
    pairs = [(f, 1.0 / r) for f, r in zip(fracs, rates) if r]
    if not pairs:
        return None
    return sum(f * t for f, t in pairs) / sum(t for _, t in pairs)


def descendants(pid):
    """All descendant pids of `pid` (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# ------------------------------------------------------------------------------ profile

GROUPS = [
    ("memcpy / copies", r"memcpy|memmove|memset|copy_|clone"),
    ("libtorch conv/gemm (oneDNN/MKL/BLAS; [JIT] = oneDNN's generated kernels)",
     r"\[JIT\]|dnnl|mkldnn|gemm|sgemm|mkl_|blas|jit_|avx512|avx2_|convolution|conv2d|im2col|"
     r"col2im|winograd|brgemm|libgomp"),
    ("libtorch max-pool fwd/bwd", r"max_pool"),
    ("libtorch BatchNorm fwd/bwd", r"batch_norm"),
    ("libtorch elementwise loops (ReLU, normalise, SGD, loss; AVX2 vectorized)",
     r"AVX2::|AVX512::|DEFAULT::|vectorized|relu|threshold"),
    ("libtorch other (autograd, dispatch, ...)", r"libtorch|libc10|at::|c10::|torch::"),
    ("JPEG decode", r"jpeg|jpg|idct|huffman|decode_mcu|ycbcr|ycc|upsampl|zune|mozjpeg|turbo"),
    ("resize / transform", r"resize|imageops|bilinear|resample|fast_image_resize"),
    ("allocator", r"malloc|free|_int_|alloc|mmap|munmap|jemalloc|tcache|unlink_chunk"),
    ("all-reduce / network / runtime (tokio, sockets, futex)",
     r"allreduce|ring|tcp|socket|send|recv|epoll|tokio|mio|futex|quinn|rustls|chacha|aes|poly1305|ghash"),
    ("python interpreter", r"python|libpython|_PyEval|PyObject"),
    ("kernel (syscalls, page faults, scheduling)", r"\[kernel|kallsyms"),
]


def group_of(dso, sym):
    text = f"{dso} {sym}"
    for name, pattern in GROUPS:
        if re.search(pattern, text, re.IGNORECASE):
            return name
    return "other"


def profile(pid, seconds, out_dir):
    """perf record one process for `seconds`; returns (groups, top symbols, threads)."""
    if not shutil.which("perf"):
        return None, "perf not found (apt-get install -y linux-perf)"
    data = os.path.join(out_dir, "perf.data")
    rec = subprocess.run(["perf", "record", "-F", "499", "-p", str(pid), "-o", data, "--",
                          "sleep", str(seconds)], capture_output=True, text=True)
    if rec.returncode != 0 or not os.path.exists(data):
        return None, f"perf record failed: {rec.stderr.strip()[-400:]}"
    rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children",
                          "--sort", "dso,sym", "--percent-limit", "0"],
                         capture_output=True, text=True)
    rows = []
    for line in rep.stdout.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\[JIT\] tid \d+|\S+)\s+\[(.)\]\s+(.*)$", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3), m.group(4).strip()))
    groups = {}
    for pct, dso, kind, sym in rows:
        g = group_of(dso if kind != "k" else "[kernel]", sym)
        groups[g] = groups.get(g, 0.0) + pct
    thr = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children",
                          "--sort", "comm", "--percent-limit", "1"], capture_output=True, text=True)
    threads = [line.strip() for line in thr.stdout.splitlines()
               if re.match(r"\s*[\d.]+%", line)]
    return {"groups": sorted(groups.items(), key=lambda kv: -kv[1]), "top": rows[:25],
            "threads": threads}, None


# ------------------------------------------------------------------------------- runners


class CpuMeter:
    """CPU seconds of a process and all its descendants, sampled every 0.2 s (the last
    sample of each process before it ends; a share of the last 0.2 s is missed). On a
    shared machine, images per CPU-second say more than images per second."""

    def __init__(self, pid):
        self.pid, self.seen, self.stop = pid, {}, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            for p in [self.pid] + descendants(self.pid):
                cpu = cpu_seconds(p)
                if cpu is not None:
                    self.seen[p] = max(cpu, self.seen.get(p, 0.0))
            self.stop.wait(0.2)

    def total(self):
        self.stop.set()
        self.thread.join()
        return sum(self.seen.values())


def run_imgrun(args, cfg, train_spec, val_spec, tmp, tag, do_perf, variant=()):
    runs_dir = os.path.join(tmp, "runs")
    name = f"cmp-{tag}" + ("-variant" if variant else "")
    cmd = [args.imgrun, "train", "--config", args.config, "--embedded", "--cpu-trainers", "2",
           "--epochs", str(args.epochs), "--no-plot", "--name", name,
           "--set", f'data.train="{train_spec}"', "--set", f'data.val="{val_spec}"',
           "--set", f'train.runs_dir="{runs_dir}"',
           "--set", f"train.threads={args.threads}", "--set", f"data.loader_workers={args.loader_workers}"]
    if args.model:
        cmd += ["--set", f'model.name="{args.model}"']
    if args.image_size:
        cmd += ["--set", f"data.image_size={args.image_size}", "--set", f"data.eval_size={args.image_size}"]
    cmd += [item for pair in (("--set", x) for x in list(args.imgrun_set) + list(variant))
            for item in pair]
    log = os.path.join(tmp, f"{name}.log")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        meter = CpuMeter(proc.pid)
        prof = {}
        if do_perf:
            def sampler():
                deadline = time.time() + args.perf_delay
                while time.time() < deadline and proc.poll() is None:
                    time.sleep(0.5)
                workers = [p for p in descendants(proc.pid) if " worker" in cmdline(p)]
                if not workers:
                    prof["error"] = "no `imgrun worker` child process found"
                    return
                # The busiest worker: the one that has used the most CPU so far.
                pid = max(workers, key=lambda p: cpu_seconds(p) or 0.0)
                prof["pid"], prof["cmd"] = pid, cmdline(pid)[:160]
                result, err = profile(pid, args.perf, tmp)
                prof["result"], prof["error"] = result, err
            th = threading.Thread(target=sampler, daemon=True)
            th.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            rc = "timeout"
        if do_perf:
            th.join(timeout=args.perf + 30)
    cpu = meter.total()
    wall = time.perf_counter() - t0
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"imgrun train failed ({rc}); log {log}:\n{tail}")
    metrics = os.path.join(runs_dir, name, "metrics.jsonl")
    epochs, steps, evals = [], [], []
    with open(metrics) as f:
        for line in f:
            rec = json.loads(line)
            kind = rec.get("kind")
            if kind == "epoch":
                epochs.append(rec)
            elif kind == "step":
                steps.append(rec)
            elif kind == "eval":
                evals.append(rec)
    ips = [e["images_per_s"] for e in epochs]
    dw = [e["data_wait_fraction"] for e in epochs]
    later = [s for s in steps if s["epoch"] >= 1] or steps
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    per_epoch_images = [sum(s["samples"] for s in steps if s["epoch"] == e["epoch"]) for e in epochs]
    train_s = sum(n / r for n, r in zip(per_epoch_images, ips) if r)
    return {
        "side": "imgrun-variant" if variant else "imgrun", "tag": tag, "rc": rc,
        "ips_all": steady(ips), "ips_steady": steady(ips[1:]) if len(ips) > 1 else None,
        "wait_all": time_weighted(dw, ips), "wait_steady": time_weighted(dw[1:], ips[1:]),
        "allreduce_ms": 1000 * mean([s["allreduce_s"] for s in later]),
        "step_ms": 1000 * mean([s["step_s"] for s in later]),
        "compute_ms": 1000 * mean([s.get("compute_s", 0.0) for s in later]),
        "top1": evals[-1]["top1"] if evals else None,
        "train_s": train_s, "wall_s": wall, "cpu_s": cpu, "epochs": len(epochs),
        "images": sum(per_epoch_images),
        "steps_per_epoch": len(steps) // max(1, len(epochs)),
        "history": [round(x, 1) for x in ips], "log": log, "profile": prof or None,
    }


def run_ddp(args, cfg, train_dir, val_dir, tmp, tag, synthetic):
    d, m, t = cfg["data"], cfg["model"], cfg["train"]
    cmd = [args.python, DDP, "--world-size", "2", "--threads", str(args.threads),
           "--workers", str(args.loader_workers), "--prefetch", str(d.get("queue_batches", 2)),
           "--model", m["name"], "--width", str(m["width"]), "--size", str(d["image_size"]),
           "--batch", str(t["batch_size"]),
           "--base-lr", str(t["lr"] * 256 / t.get("reference_batch", 256)),
           "--warmup-epochs", str(t["warmup_epochs"]),
           "--warmup-start-fraction", str(t.get("warmup_start_fraction", 0.0)),
           "--weight-decay", str(t["weight_decay"]),
           "--label-smoothing", str(t.get("label_smoothing", 0.0)),
           "--epochs", str(args.epochs), "--init", "tch", "--eval-every", "1"]
    if t.get("nesterov"):
        cmd.append("--nesterov")
    if synthetic:
        cmd.append("--synthetic")
    else:
        cmd += ["--train", train_dir, "--val", val_dir, "--eval-mode", "resize"]
        if d.get("mode", "resampled") == "resampled":
            cmd.append("--resampled")
        if tuple(d.get("crop_scale", (0.35, 1.0))) == (1.0, 1.0) and not d.get("flip", True):
            cmd.append("--no-augment")
        else:
            cmd += ["--crop-scale-min", str(d["crop_scale"][0])]
    log = os.path.join(tmp, f"ddp-{tag}{'-syn' if synthetic else ''}.log")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        meter = CpuMeter(child.pid)
        try:
            child.wait(timeout=args.timeout)
        finally:
            cpu = meter.total()
            if child.poll() is None:
                child.kill()
                child.wait()
    wall = time.perf_counter() - t0
    with open(log) as f:
        text = f.read()
    if child.returncode != 0:
        raise SystemExit(f"ddp_train.py failed ({child.returncode}); log {log}:\n{text[-3000:]}")
    summary = next(json.loads(line) for line in text.splitlines() if line.startswith('{"summary"'))
    hist = summary["history"]
    ips = [h["images_per_s"] for h in hist]
    dw = [h["data_wait_fraction"] for h in hist]
    steps_per_epoch = summary["steps"] // max(1, summary["epochs"])
    return {
        "side": "ddp-syn" if synthetic else "ddp", "tag": tag, "rc": 0,
        "ips_all": steady(ips), "ips_steady": steady(ips[1:]) if len(ips) > 1 else None,
        "wait_all": time_weighted(dw, ips), "wait_steady": time_weighted(dw[1:], ips[1:]),
        "allreduce_ms": None, "compute_ms": None,
        "step_ms": 1000 * 2 * 64 / steady(ips[1:] or ips) if ips else None,
        "top1": summary.get("top1"), "train_s": summary["train_seconds"], "wall_s": wall,
        "cpu_s": cpu, "images": summary["steps"] * 2 * args_batch(cfg),
        "epochs": len(hist), "steps_per_epoch": steps_per_epoch,
        "history": [round(x, 1) for x in ips], "log": log, "profile": None,
        "command": " ".join(cmd),
    }


# --------------------------------------------------------------------------------- main


def args_batch(cfg):
    return cfg["train"]["batch_size"]


def per_cpu(row):
    """Training images (all epochs; evaluation and start-up are in the CPU time too) per
    CPU-second of every process of the run."""
    images = row.get("images")
    return images / row["cpu_s"] if images and row.get("cpu_s") else None


def table(rows):
    head = ("run", "side", "img/s all", "img/s steady", "wait all", "wait steady", "allred ms/step",
            "fwd+bwd ms", "step ms", "top1", "train s", "wall s", "cpu s", "img/cpu-s", "load before",
            "load after")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = [head]
    for r in rows:
        lines.append((r["tag"], r["side"], fmt(r["ips_all"], ".0f"), fmt(r["ips_steady"], ".0f"),
                      fmt(r["wait_all"] and 100 * r["wait_all"], ".1f") + "%",
                      fmt(r["wait_steady"] and 100 * r["wait_steady"], ".1f") + "%",
                      fmt(r["allreduce_ms"], ".1f"), fmt(r["compute_ms"], ".1f"), fmt(r["step_ms"], ".1f"),
                      fmt(r["top1"] and 100 * r["top1"], ".2f"), fmt(r["train_s"], ".1f"),
                      fmt(r["wall_s"], ".1f"), fmt(r.get("cpu_s"), ".1f"), fmt(per_cpu(r), ".1f"),
                      fmt_load(r["load_before"]), fmt_load(r["load_after"])))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(str(c).rjust(w) if i > 1 else str(c).ljust(w)
                             for i, (c, w) in enumerate(zip(line, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (steady state: 2nd on)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each side, interleaved")
    p.add_argument("--no-synthetic", action="store_true", help="skip the ddp --synthetic runs")
    p.add_argument("--sides", help="comma-separated subset of imgrun,ddp,ddp-syn to run")
    p.add_argument("--config", default="examples/demo.toml")
    p.add_argument("--model", help="model.name for both sides (small_cnn, resnet18); default the config's")
    p.add_argument("--image-size", type=int, help="data.image_size (and eval_size) for both sides")
    p.add_argument("--imgrun-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `--set` for imgrun only (e.g. train.overlap=false)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                   help="also run imgrun with these `--set`s (side imgrun-variant), e.g. "
                        "train.overlap=false")
    p.add_argument("--imgrun", default=os.path.join(ROOT, "target", "release", "imgrun"))
    p.add_argument("--python", default=sys.executable, help="python of the torch venv")
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "imgrun-compare-data"),
                   help="folder for the shards (kept and reused)")
    p.add_argument("--threads", type=int, default=1, help="libtorch threads per trainer/rank")
    p.add_argument("--loader-workers", type=int, default=1, help="loader workers per rank")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--perf", type=float, default=0.0,
                   help="perf-record an imgrun trainer for this many seconds (first imgrun run)")
    p.add_argument("--perf-delay", type=float, default=15.0,
                   help="seconds after the imgrun start before recording")
    p.add_argument("--json", help="write all runs' figures here")
    p.add_argument("--keep", action="store_true", help="keep the temp folder (logs, runs)")
    args = p.parse_args()
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (steady state leaves out the first epoch)")

    os.chdir(ROOT)
    if not os.path.exists(args.imgrun):
        raise SystemExit(f"{args.imgrun} is missing: cargo build --release --bin imgrun")
    cfg = read_toml(args.config)
    cfg.setdefault("data", {}).setdefault("queue_batches", 2)
    if args.model:
        cfg["model"]["name"] = args.model
    if args.image_size:
        cfg["data"]["image_size"] = cfg["data"]["eval_size"] = args.image_size
    d = cfg["data"]
    if d.get("image_size") != d.get("eval_size", d.get("image_size")) or d.get("resize_ratio", 1.0) != 1.0:
        print("# warning: eval transform is not a plain resize to image_size; ddp --eval-mode resize differs")
    os.makedirs(args.data, exist_ok=True)
    train_dir = make_shards(args.imgrun, args.data, 1000, 1, "demo-train")
    val_dir = make_shards(args.imgrun, args.data, 200, 2, "demo-val")
    train_spec, n_train = brace_spec(train_dir, "demo-train")
    val_spec, n_val = brace_spec(val_dir, "demo-val")
    tmp = tempfile.mkdtemp(prefix="imgrun-compare-")

    t, m = cfg["train"], cfg["model"]
    print(f"# machine: {os.cpu_count()} CPUs, load {fmt_load(load())} (1/5/15 min)")
    print(f"# settings: {m['name']} width {m['width']}, {d['image_size']} px (eval {d.get('eval_size')}), "
          f"batch {t['batch_size']}/rank x 2 ranks, lr {t['lr']} per {t.get('reference_batch', 256)} "
          f"(peak {t['lr'] * 2 * t['batch_size'] / t.get('reference_batch', 256):.3f}), "
          f"wd {t['weight_decay']}, warm-up {t['warmup_epochs']} ep from {t.get('warmup_start_fraction')}, "
          f"{t['schedule']}, {args.epochs} epochs, {args.threads} thread(s) + {args.loader_workers} "
          f"loader worker(s) per rank, mode {d.get('mode')}, crop_scale {d.get('crop_scale')}, "
          f"flip {d.get('flip')}, queue/prefetch {d['queue_batches']}")
    print(f"# data: {n_train} train shards {train_spec}; {n_val} val shards {val_spec}")
    print(f"# logs and runs: {tmp}", flush=True)

    rows = []
    for rep in range(args.repeat):
        sides = ["imgrun", "ddp"] + ([] if args.no_synthetic else ["ddp-syn"])
        if args.variant:
            sides.insert(1, "imgrun-variant")
        sides = [s for s in sides if not args.sides or s in args.sides.split(",")]
        if rep % 2 == 1:
            sides.reverse()
        for side in sides:
            tag = f"r{rep + 1}"
            before = load()
            print(f"# {tag} {side}: start, load {fmt_load(before)}", flush=True)
            if side == "imgrun":
                row = run_imgrun(args, cfg, train_spec, val_spec, tmp, tag,
                                 do_perf=args.perf > 0 and rep == 0)
            elif side == "imgrun-variant":
                row = run_imgrun(args, cfg, train_spec, val_spec, tmp, tag, do_perf=False,
                                 variant=args.variant)
            else:
                row = run_ddp(args, cfg, train_dir, val_dir, tmp, tag, synthetic=side == "ddp-syn")
            row["load_before"], row["load_after"] = before, load()
            rows.append(row)
            print(f"# {tag} {side}: {row['ips_all']:.0f} img/s all, "
                  f"{(row['ips_steady'] or 0):.0f} steady, per epoch {row['history']}, "
                  f"top1 {row['top1']}, wall {row['wall_s']:.1f}s, load after {fmt_load(row['load_after'])}",
                  flush=True)

    print()
    print(table(rows))
    print()

    def mean_of(side, key):
        vals = [r[key] for r in rows if r["side"] == side and r[key] is not None]
        return sum(vals) / len(vals) if vals else None

    for r in rows:
        r["images_per_cpu_s"] = per_cpu(r)
    for key, label in (("ips_steady", "images/s steady"), ("ips_all", "images/s all epochs"),
                       ("images_per_cpu_s", "training images per CPU-second of the whole run")):
        a, b, c = mean_of("imgrun", key), mean_of("ddp", key), mean_of("ddp-syn", key)
        if a is None or b is None:
            print(f"{label}: imgrun {a}, PyTorch DDP {b}")
            continue
        line = f"{label}: imgrun {a:.0f}, PyTorch DDP {b:.0f} -> imgrun/PyTorch = {a / b:.2f}"
        if c:
            line += f"; PyTorch compute-only {c:.0f} (imgrun at {a / c:.0%} of it, DDP at {b / c:.0%})"
        print(line)
    if args.variant:
        a, v = mean_of("imgrun", "ips_steady"), mean_of("imgrun-variant", "ips_steady")
        if a and v:
            print(f"images/s steady: imgrun {a:.0f}, imgrun with {' '.join(args.variant)} {v:.0f} "
                  f"-> {a / v:.2f}x; allreduce wait per step {mean_of('imgrun', 'allreduce_ms'):.1f} "
                  f"against {mean_of('imgrun-variant', 'allreduce_ms'):.1f} ms")
    a, b = mean_of("imgrun", "top1"), mean_of("ddp", "top1")
    if a is not None and b is not None:
        print(f"val top-1 after {args.epochs} epochs: imgrun {100 * a:.2f}%, PyTorch {100 * b:.2f}%")
    one = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"wall: imgrun {one(mean_of('imgrun', 'wall_s'))}s, PyTorch {one(mean_of('ddp', 'wall_s'))}s "
          "(start-up, eval and imgrun's per-epoch checkpoints included)")
    print("\nMismatches that remain:")
    for item in MISMATCHES:
        print(f"  - {item}")

    prof = next((r["profile"] for r in rows if r.get("profile")), None)
    if prof:
        print(f"\nProfile of an imgrun trainer ({prof.get('cmd', '?')}, pid {prof.get('pid')}, "
              f"{args.perf:.0f} s of perf samples, self time):")
        if prof.get("error"):
            print(f"  {prof['error']}")
        res = prof.get("result")
        if res:
            for name, pct in res["groups"]:
                print(f"  {pct:5.1f}%  {name}")
            print("  threads:")
            for line in res["threads"][:10]:
                print(f"    {line}")
            print("  top symbols:")
            for pct, dso, _, sym in res["top"][:20]:
                print(f"    {pct:5.2f}%  {dso:28.28s}  {sym[:90]}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "settings": vars(args), "config": cfg}, f, indent=1, default=str)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"\n# kept {tmp}")


if __name__ == "__main__":
    main()
