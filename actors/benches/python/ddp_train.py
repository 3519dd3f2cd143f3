"""PyTorch DDP reference for `imgrun train`: the same small CNN, optimiser, schedule and
augmentation, trained from WebDataset shards with N gloo processes on loopback.

It is the baseline `imgrun train` is benchmarked against (images/s, data-wait fraction,
val top-1), and the tool used to choose the recipe of imgrun's embedded demo.

Setup (once): the torch venv made by tools/libtorch.sh has torch but neither webdataset
nor Pillow; add them (torchvision is not needed, the transforms are written out below):

    /root/.cache/imgrun/torch-2.11.0/bin/pip install webdataset pillow

Data (train and a held-out val set, different seeds; --maxcount 250 gives enough shards
for 2 ranks x 2 workers; generation takes about 4 s for 10 x 1000 on 2 cores):

    target/release/imgrun shards synth /tmp/synth-train1000 --per-class 1000 --seed 1 --maxcount 250
    target/release/imgrun shards synth /tmp/synth-val --per-class 200 --seed 2 --prefix demo-val \
        --maxcount 250

Run the demo recipe (spawns --world-size ranks itself; 2 ranks x 1 thread x 1 loader
worker by default; reached 95.2% val top-1 in 121 s of training on a 2-core machine):

    PY=/root/.cache/imgrun/torch-2.11.0/bin/python
    $PY actors/benches/python/ddp_train.py --train /tmp/synth-train1000 --val /tmp/synth-val \
        --width 16 --size 48 --batch 64 --base-lr 0.4 --warmup-epochs 0.5 --epochs 10 --no-augment
    # compute only, no loader: the same fixed random batch every step, no eval
    $PY actors/benches/python/ddp_train.py --synthetic --width 16 --size 48 --batch 64 --steps 150

It also runs under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set): then it does not spawn.

Models: `--model small_cnn` (the default) or `--model resnet18` (tch's ResNet-18, which is
torchvision's). The small CNN (must match the Rust SmallCnn): block(cin, cout) = Conv2d 3x3 s1 p1 no bias ->
BatchNorm2d -> ReLU; block(3,w) pool block(w,2w) pool block(2w,4w) pool block(4w,8w)
-> global average pool -> Linear(8w, classes). Plain (per-rank) BatchNorm; DDP
broadcasts rank 0's BN buffers each forward.

Optimiser: SGD momentum 0.9 (optionally Nesterov), weight decay on conv/linear weights
only, lr = base_lr * global_batch / 256, linear warm-up from 0 then cosine to 0, per step.

Train transform: RandomResizedCrop(S, scale=(smin, 1), ratio=(3/4, 4/3)) as torchvision
draws it (10 tries, then a centre crop), bilinear resize of the crop box (Pillow),
horizontal flip p=0.5, to [0,1], ImageNet mean/std. `--no-augment`: plain resize to S.
Eval transform (`--eval-mode`): `resize` (default) = plain resize of the whole image to
S, since synth images are small and the shape may touch the border; `center` =
Resize(round(S/0.875), shorter side) + CenterCrop(S), the ImageNet convention.

Data split: training shards are dealt to ranks round-robin, then to each rank's loader
workers; every worker cycles through its shards forever (shard order reshuffled each
pass, 1000-sample shuffle buffer), and an epoch is floor(train_images / global_batch)
steps, so ranks always take the same number of steps. `--resampled` instead lets every
worker draw shards at random with replacement (webdataset's resampled mode). Val
samples are split by index (sample i goes to rank i % N), counts are all-reduced.

Output: one line per epoch, then one JSON line starting with `{"summary"`.
images/s = training images over all ranks / training seconds (eval excluded, slowest
rank); data-wait fraction = seconds blocked in next(loader) / training seconds (mean of
ranks).
"""

import argparse
import glob
import io
import json
import math
import os
import random
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


# ----------------------------------------------------------------------------- model


def block(cin, cout):
    return [nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCnn(nn.Module):
    def __init__(self, width, classes):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            *block(3, w), nn.MaxPool2d(2),
            *block(w, 2 * w), nn.MaxPool2d(2),
            *block(2 * w, 4 * w), nn.MaxPool2d(2),
            *block(4 * w, 8 * w),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(8 * w, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    """torchvision's (and tch's) ResNet basic block: two 3x3 convs, a 1x1 projection when
    the shape changes."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu((x if self.downsample is None else self.downsample(x)) + y)


class ResNet18(nn.Module):
    """ResNet-18 as tch::vision::resnet::resnet18 builds it (torchvision's layout: 7x7 s2
    stem, max-pool, 4 stages of 2 basic blocks, global average pool, linear)."""

    def __init__(self, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = nn.functional.adaptive_avg_pool2d(self.layers(x), 1)
        return self.fc(torch.flatten(x, 1))


def param_groups(model, weight_decay):
    """Weight decay on conv and linear weights only; none on biases or BatchNorm."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, (nn.Conv2d, nn.Linear)) and name == "weight":
                decay.append(p)
            else:
                no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step, total, warmup, peak, start_fraction=None):
    """Linear warm-up from 0 to `peak` over `warmup` steps, then cosine to 0.

    With `start_fraction` (imgrun's train.warmup_start_fraction) the warm-up is imgrun's:
    peak * (f + (1 - f) * step / warmup)."""
    if step < warmup:
        if start_fraction is not None:
            return peak * (start_fraction + (1.0 - start_fraction) * step / warmup)
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


# ------------------------------------------------------------------------- transforms


def random_resized_crop_box(width, height, scale, ratio, rng):
    """torchvision's RandomResizedCrop.get_params, with Python's random."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            i = rng.randint(0, height - h)
            j = rng.randint(0, width - w)
            return j, i, w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def to_tensor(img):
    import numpy as np
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255)
    for c in range(3):
        x[c].sub_(MEAN[c]).div_(STD[c])
    return x


class TrainTransform:
    def __init__(self, size, scale_min, augment):
        self.size, self.scale, self.augment = size, (scale_min, 1.0), augment
        self.rng = random.Random()

    def __call__(self, img):
        from PIL import Image
        img = img.convert("RGB")
        s = self.size
        if not self.augment:
            return to_tensor(img.resize((s, s), Image.BILINEAR) if img.size != (s, s) else img)
        j, i, w, h = random_resized_crop_box(img.width, img.height, self.scale, (3 / 4, 4 / 3), self.rng)
        img = img.resize((s, s), Image.BILINEAR, box=(j, i, j + w, i + h))
        if self.rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return to_tensor(img)


class EvalTransform:
    def __init__(self, size, mode):
        self.size, self.mode = size, mode

    def __call__(self, img):
        from PIL import Image
        img = img.convert("RGB")
        s = self.size
        if self.mode == "resize":
            return to_tensor(img.resize((s, s), Image.BILINEAR) if img.size != (s, s) else img)
        short = int(round(s / 0.875))
        w, h = img.size
        if w <= h:
            nw, nh = short, int(short * h / w)
        else:
            nw, nh = int(short * w / h), short
        img = img.resize((nw, nh), Image.BILINEAR)
        left, top = int(round((nw - s) / 2)), int(round((nh - s) / 2))
        return to_tensor(img.crop((left, top, left + s, top + s)))


# ------------------------------------------------------------------------------ data


def shard_urls(folder):
    urls = sorted(glob.glob(os.path.join(folder, "*.tar")))
    if not urls:
        raise SystemExit(f"no *.tar shards in {folder}")
    return urls


def count_samples(folder):
    """Sample count from manifest.json when it says, else by reading the shards."""
    path = os.path.join(folder, "manifest.json")
    if os.path.exists(path):
        with open(path) as f:
            manifest = json.load(f)
        for key in ("samples", "count", "total_samples", "num_samples"):
            if isinstance(manifest.get(key), int):
                return manifest[key]
        shards = manifest.get("shards")
        if isinstance(shards, list) and shards and all(isinstance(s, dict) for s in shards):
            for key in ("samples", "count", "num_samples"):
                if all(isinstance(s.get(key), int) for s in shards):
                    return sum(s[key] for s in shards)
    import tarfile
    keys = set()
    for url in shard_urls(folder):
        with tarfile.open(url) as tar:
            keys.update(m.name.split(".", 1)[0] for m in tar.getmembers() if m.isfile())
    return len(keys)


class TrainStream(torch.utils.data.IterableDataset):
    """Endless (image, label) stream of one rank: its shards, split among its workers."""

    def __init__(self, urls, rank, world, transform, seed, resampled):
        super().__init__()
        self.urls, self.rank, self.world = urls, rank, world
        self.transform, self.seed, self.resampled = transform, seed, resampled

    def __iter__(self):
        import webdataset as wds
        info = torch.utils.data.get_worker_info()
        wid, nworkers = (info.id, info.num_workers) if info else (0, 1)
        stream_id = self.rank * nworkers + wid
        self.transform.rng = random.Random(self.seed * 1000003 + stream_id)
        if self.resampled:
            mine = self.urls
        else:
            rank_urls = self.urls[self.rank::self.world]
            mine = rank_urls[wid::nworkers] if len(rank_urls) >= nworkers else rank_urls
            if not mine:
                raise RuntimeError(
                    f"{len(self.urls)} shards cannot feed {self.world} ranks; "
                    "write more shards (--max-count) or pass --resampled")
        rng = random.Random(self.seed * 7919 + stream_id)
        epoch = 0
        while True:
            order = list(mine)
            rng.shuffle(order)
            ds = wds.WebDataset(
                order, resampled=self.resampled, shardshuffle=False, nodesplitter=None,
                workersplitter=None, empty_check=False, seed=self.seed + stream_id + 10007 * epoch,
            ).shuffle(1000, rng=random.Random(rng.random())).decode("pil").to_tuple("jpg", "cls")
            for img, cls in ds:
                yield self.transform(img), int(cls)
            epoch += 1


class ValStream(torch.utils.data.IterableDataset):
    """This rank's share of the val set: sample i goes to stream i % (world * workers)."""

    def __init__(self, urls, rank, world, transform):
        super().__init__()
        self.urls, self.rank, self.world, self.transform = urls, rank, world, transform

    def __iter__(self):
        import webdataset as wds
        from PIL import Image
        info = torch.utils.data.get_worker_info()
        wid, nworkers = (info.id, info.num_workers) if info else (0, 1)
        streams, me = self.world * nworkers, self.rank * nworkers + wid
        ds = wds.WebDataset(self.urls, shardshuffle=False, nodesplitter=None,
                            workersplitter=None, empty_check=False)
        for i, sample in enumerate(ds):
            if i % streams == me:
                img = Image.open(io.BytesIO(sample["jpg"]))
                yield self.transform(img), int(sample["cls"])


# --------------------------------------------------------------------------- training


def evaluate(model, loader, device_counts):
    model.eval()
    correct1 = correct5 = seen = 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            top5 = out.topk(min(5, out.shape[1]), dim=1).indices
            correct1 += (top5[:, 0] == y).sum().item()
            correct5 += (top5 == y[:, None]).any(dim=1).sum().item()
            seen += y.numel()
    counts = torch.tensor([correct1, correct5, seen], dtype=torch.float64)
    dist.all_reduce(counts)
    model.train()
    c1, c5, n = counts.tolist()
    return c1 / max(n, 1), c5 / max(n, 1), int(n)


def run(rank, world, args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    main = rank == 0

    def log(*parts):
        if main:
            print(*parts, flush=True)

    classes = args.classes
    if not args.synthetic and os.path.exists(os.path.join(args.train, "classes.txt")):
        with open(os.path.join(args.train, "classes.txt")) as f:
            classes = len([line for line in f if line.strip()])
    model = SmallCnn(args.width, classes) if args.model == "small_cnn" else ResNet18(classes)
    if args.init == "tch":
        # imgrun's (tch's) default: Kaiming-uniform with the ReLU gain, fan-in, for conv
        # and linear weights (bound sqrt(6/fan_in), PyTorch's is 1/sqrt(fan_in)); linear
        # bias U(+-1/sqrt(fan_in)) and BatchNorm (1, 0) are the same on both sides.
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_uniform_(module.weight, a=0.0, mode="fan_in", nonlinearity="relu")
    ddp = nn.parallel.DistributedDataParallel(model)
    global_batch = args.batch * world
    peak_lr = args.base_lr * global_batch / 256
    opt = torch.optim.SGD(param_groups(model, args.weight_decay), lr=peak_lr,
                          momentum=0.9, nesterov=args.nesterov)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    if args.synthetic:
        train_images = args.batch * world * (args.steps or 100)
    else:
        train_images = count_samples(args.train)
    steps_per_epoch = max(1, train_images // global_batch)
    if args.steps:
        total_steps, epochs = args.steps, math.ceil(args.steps / steps_per_epoch)
    else:
        total_steps, epochs = steps_per_epoch * args.epochs, args.epochs
    warmup = int(round(args.warmup_epochs * steps_per_epoch))

    if args.synthetic:
        g = torch.Generator().manual_seed(args.seed + rank)
        fixed = (torch.randn(args.batch, 3, args.size, args.size, generator=g),
                 torch.randint(0, classes, (args.batch,), generator=g))
        batches = iter(lambda: fixed, None)
        val_loader = None
    else:
        train_ds = TrainStream(shard_urls(args.train), rank, world,
                               TrainTransform(args.size, args.crop_scale_min, not args.no_augment),
                               args.seed, args.resampled)
        loader = torch.utils.data.DataLoader(
            train_ds, batch_size=args.batch, num_workers=args.workers, drop_last=True,
            persistent_workers=args.workers > 0, prefetch_factor=args.prefetch if args.workers else None)
        batches = iter(loader)
        val_ds = ValStream(shard_urls(args.val), rank, world, EvalTransform(args.size, args.eval_mode)) \
            if args.val else None
        val_loader = torch.utils.data.DataLoader(
            val_ds, batch_size=256, num_workers=args.workers,
            persistent_workers=args.workers > 0) if val_ds else None
    # The first batch waits for worker start-up (seconds); it is timed apart, as start-up.
    t_start = time.perf_counter()
    first = next(batches)
    startup = torch.tensor([time.perf_counter() - t_start], dtype=torch.float64)
    dist.all_reduce(startup, op=dist.ReduceOp.MAX)
    pending = [first]

    log(f"# start-up (first batch) {startup.item():.1f}s")
    log(f"# world={world} threads={args.threads} workers={args.workers} width={args.width} "
        f"size={args.size} batch/rank={args.batch} peak_lr={peak_lr:.4f} steps/epoch={steps_per_epoch} "
        f"epochs={epochs} total_steps={total_steps} warmup={warmup} train_images={train_images} "
        f"classes={classes} params={sum(p.numel() for p in model.parameters())}")

    step = 0
    train_seconds = wait_seconds = 0.0
    images = 0
    top1 = top5 = None
    history = []
    wall0 = time.perf_counter()
    for epoch in range(epochs):
        loss_sum = torch.zeros(2, dtype=torch.float64)
        t_epoch = wait_epoch = 0.0
        n_epoch = 0
        while step < total_steps and n_epoch < steps_per_epoch:
            t0 = time.perf_counter()
            x, y = pending.pop() if pending else next(batches)
            t1 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total_steps, warmup, peak_lr, args.warmup_start_fraction)
            out = ddp(x)
            loss = criterion(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.tensor([loss.item() * y.numel(), y.numel()], dtype=torch.float64)
            t2 = time.perf_counter()
            t_epoch += t2 - t0
            wait_epoch += t1 - t0
            n_epoch += 1
            step += 1
        # Per-epoch figures over all ranks: slowest rank's time, mean wait fraction.
        stats = torch.tensor([loss_sum[0], loss_sum[1], wait_epoch / max(t_epoch, 1e-9)], dtype=torch.float64)
        dist.all_reduce(stats)
        slow = torch.tensor([t_epoch], dtype=torch.float64)
        dist.all_reduce(slow, op=dist.ReduceOp.MAX)
        epoch_images = n_epoch * global_batch
        images += epoch_images
        train_seconds += slow.item()
        wait_seconds += stats[2].item() / world * slow.item()
        ips = epoch_images / slow.item()
        wait_frac = stats[2].item() / world
        loss_avg = (stats[0] / stats[1]).item()
        last = epoch == epochs - 1
        if val_loader is not None and (last or (args.eval_every and (epoch + 1) % args.eval_every == 0)):
            top1, top5, n_val = evaluate(ddp, val_loader, None)
            val = f"val top1 {top1 * 100:.2f}% top5 {top5 * 100:.2f}% (n={n_val})"
        else:
            val = "val -"
        history.append({"epoch": epoch + 1, "loss": round(loss_avg, 4),
                        "top1": None if top1 is None or val == "val -" else round(top1, 4),
                        "train_s": round(train_seconds, 1), "images_per_s": round(ips, 1),
                        "data_wait_fraction": round(wait_frac, 3)})
        log(f"epoch {epoch + 1}/{epochs} loss {loss_avg:.4f} {val} | {ips:.0f} img/s "
            f"data-wait {wait_frac * 100:.1f}% | train {train_seconds:.1f}s "
            f"wall {time.perf_counter() - wall0:.1f}s")

    summary = {
        "summary": "ddp_train",
        "images_per_s": round(images / train_seconds, 1),
        "data_wait_fraction": round(wait_seconds / train_seconds, 3),
        "top1": None if top1 is None else round(top1, 4),
        "top5": None if top5 is None else round(top5, 4),
        "train_seconds": round(train_seconds, 1),
        "seconds": round(time.perf_counter() - wall0, 1),
        "startup_seconds": round(startup.item(), 1),
        "epochs": epochs, "steps": step,
        "settings": {k: v for k, v in vars(args).items()} | {"world_size": world, "peak_lr": peak_lr,
                                                              "global_batch": global_batch},
        "history": history,
    }
    log(json.dumps(summary))
    dist.barrier()
    # The DDP reducer holds gloo work; drop it before the group, then leave without the
    # interpreter's teardown: gloo's worker threads dying during finalisation abort the
    # process ("terminate called without an active exception", SIGABRT) now and then,
    # which failed `make bench` after every figure had been printed.
    del ddp
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawned(rank, world, args):
    run(rank, world, args)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", help="folder of training shards (*.tar, manifest.json)")
    p.add_argument("--val", help="folder of held-out shards")
    p.add_argument("--synthetic", action="store_true", help="random tensors instead of the loader")
    p.add_argument("--world-size", type=int, default=2, help="ranks (processes) on loopback")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--prefetch", type=int, default=4, help="batches prefetched per worker")
    p.add_argument("--model", choices=("small_cnn", "resnet18"), default="small_cnn",
                   help="imgrun's model of that name (--width is the small CNN's)")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--classes", type=int, default=10, help="used when classes.txt is absent")
    p.add_argument("--size", type=int, default=48, help="image size S fed to the network")
    p.add_argument("--batch", type=int, default=64, help="batch per rank")
    p.add_argument("--base-lr", type=float, default=0.4, help="lr for a global batch of 256")
    p.add_argument("--warmup-epochs", type=float, default=0.5)
    p.add_argument("--warmup-start-fraction", type=float, default=None,
                   help="imgrun's warm-up: from this fraction of the peak lr (default: from 0)")
    p.add_argument("--init", choices=("torch", "tch"), default="torch",
                   help="conv/linear weight init: PyTorch's default or imgrun's (tch Kaiming-ReLU)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --epochs)")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--crop-scale-min", type=float, default=0.35)
    p.add_argument("--no-augment", action="store_true", help="plain resize, no crop or flip")
    p.add_argument("--eval-mode", choices=("resize", "center"), default="resize")
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every k epochs (0: last only)")
    p.add_argument("--resampled", action="store_true", help="draw shards with replacement")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.synthetic and not args.train:
        p.error("--train is required unless --synthetic")
    return args


def main():
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(spawned, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
