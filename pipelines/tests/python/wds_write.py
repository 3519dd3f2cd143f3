"""Writes shards with the Python `webdataset` library's ShardWriter and a manifest of
exactly what each sample's members hold, for imgrun to read back.

    wds_write.py OUTDIR

Writes OUTDIR/py-%03d.tar (plain) and OUTDIR/pygz-%03d.tar.gz (gzip-compressed), and
OUTDIR/manifest.json: {"plain": [...], "gz": [...]}, each a list of
{"shard", "key", "fields": {lower-cased name: [sha256, size]}, "cls", "json"} in write
order. The member bytes are computed with the library's own encoder, so the manifest
says what is in the tar, not what this script thinks the encoding should be.
"""

import hashlib
import io
import json
import os
import random
import sys

import numpy as np
import webdataset as wds
from PIL import Image
from webdataset.writer import make_encoder

SAMPLES = 23
MAXCOUNT = 7


def jpeg_bytes(rng, width, height):
    pixels = np.array(
        [[[rng.randrange(256) for _ in range(3)] for _ in range(width)] for _ in range(height)],
        dtype=np.uint8,
    )
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=85)
    return out.getvalue()


def make_samples():
    rng = random.Random(1234)
    samples = []
    for i in range(SAMPLES):
        # Keys with a directory part; one long enough to need a PAX or GNU long name; one
        # not ASCII.
        if i == 5:
            key = "train/" + "deep/" * 30 + f"img_{i:03d}"
        elif i == 9:
            key = f"tréîn/ünïcode_{i:03d}"
        else:
            key = f"train/n{i % 4:04d}/img_{i:03d}"
        cls = rng.randrange(1000)
        sample = {
            "__key__": key,
            "jpg": jpeg_bytes(rng, 8 + i, 6 + i % 5),
            "json": {"index": i, "label": f"class {cls}", "tags": ["a", i]},
            "txt": f"caption {i} ✓",
        }
        # The writer keeps the case of a field name; readers lower-case it.
        if i % 3 == 0:
            sample["CLS"] = cls
        else:
            sample["cls"] = cls
        if i % 4 == 1:
            sample["seg.PNG"] = jpeg_bytes(rng, 4, 4)  # any bytes: copied as they are
        if i % 5 == 2:
            sample["npy"] = np.arange(i, dtype=np.int32)
        samples.append((sample, cls))
    return samples


def write(pattern, samples, **kw):
    encode = make_encoder(True)
    manifest = []
    with wds.ShardWriter(pattern, maxcount=MAXCOUNT, verbose=0, **kw) as sink:
        for sample, cls in samples:
            sink.write(sample)
            encoded = encode(dict(sample))
            fields = {}
            for name, value in encoded.items():
                if name.startswith("_"):
                    continue
                fields[name.lower()] = [hashlib.sha256(value).hexdigest(), len(value)]
            manifest.append(
                {
                    "shard": os.path.basename(sink.fname),
                    "key": sample["__key__"],
                    "fields": fields,
                    "cls": cls,
                    "json": sample["json"],
                }
            )
    return manifest


def main():
    out = sys.argv[1]
    samples = make_samples()
    manifest = {
        "plain": write(os.path.join(out, "py-%03d.tar"), samples),
        "gz": write(os.path.join(out, "pygz-%03d.tar.gz"), samples),
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f)


if __name__ == "__main__":
    main()
