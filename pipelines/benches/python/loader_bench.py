"""Times the usual PyTorch input pipeline on WebDataset shards, for `benches/loader.rs`.

    loader_bench.py [--workers 1,2] [--batch-size 256] URL...

Rows, each one pass over every shard (files read once beforehand, so hot in the cache):

- decode: `webdataset.WebDataset` iterated in this one process, each `jpg` opened with
  PIL and converted to RGB (full-size decode), nothing else.
- train: `webdataset.WebDataset(...).decode("pil")` with torchvision's
  RandomResizedCrop(224), RandomHorizontalFlip, ToTensor and Normalize (ImageNet mean and
  std), batched by `torch.utils.data.DataLoader(batch_size, num_workers=N)`, which splits
  the shards between its worker processes. One row per N in --workers.

The first batch of every worker is warm-up (worker start, first shard open) and is not
timed; neither is interpreter start-up. CPU seconds are those of every process involved
in the timed part (this one and the workers). Prints one JSON line:
{"versions": {...}, "rows": [{"name", "kind", "workers", "images", "seconds",
"cpu_seconds"}]}.
"""

import argparse
import io
import json
import os
import resource
import sys
import time
import warnings


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    import PIL
    import torch
    import torchvision
    import webdataset

    for url in args.urls:
        with open(url, "rb") as f:
            while f.read(1 << 20):
                pass
    rows = [decode_only(args.urls)]
    for workers in (int(n) for n in args.workers.split(",") if n):
        rows.append(train(args.urls, workers, args.batch_size))
    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "webdataset": webdataset.__version__,
        "pillow": PIL.__version__,
    }
    print(json.dumps({"versions": versions, "rows": rows}))


def decode_only(urls):
    import webdataset as wds
    from PIL import Image

    images = 0
    cpu = time.process_time()
    start = time.perf_counter()
    for sample in wds.WebDataset(urls, shardshuffle=False):
        image = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
        images += image.width > 0
    seconds = time.perf_counter() - start
    return row("PIL open + convert('RGB')", "decode", 1, images, seconds, time.process_time() - cpu)


def train(urls, workers, batch_size):
    import torch
    import webdataset as wds
    from torchvision import transforms

    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )
    dataset = (
        wds.WebDataset(urls, shardshuffle=False)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(transform, lambda c: c)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers)
    children_before = children_cpu()
    batches = iter(loader)
    # Warm-up: one batch from every worker (they take turns).
    for _ in range(workers):
        next(batches)
    worker_cpu_at_start = sum(process_cpu(w.pid) for w in batches._workers)
    cpu = time.process_time()
    start = time.perf_counter()
    images = 0
    for inputs, _labels in batches:
        images += inputs.shape[0]
    seconds = time.perf_counter() - start
    main_cpu = time.process_time() - cpu
    # The workers have exited and been reaped: their whole CPU time is the children's.
    del batches
    worker_cpu = children_cpu() - children_before - worker_cpu_at_start
    name = "webdataset + torchvision RandomResizedCrop(224) ... Normalize"
    return row(name, "train_f32", workers, images, seconds, main_cpu + worker_cpu)


def row(name, kind, workers, images, seconds, cpu_seconds):
    return {
        "name": name,
        "kind": kind,
        "workers": workers,
        "images": images,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid):
    """User + system CPU seconds of a live process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        # Fields after the command name, which is in parentheses and may hold spaces.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
