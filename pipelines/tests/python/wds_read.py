"""Reads shards with the Python `webdataset` library and prints what it saw as JSON lines.

Used by `pipelines/tests/python_interop.rs` to compare imgrun with the real library.

    wds_read.py samples [--decode pil] URL...   one dataset over all URLs, a line per sample
    wds_read.py each URL...                     a dataset per URL, a line per URL with its
                                                samples or the error it raised

A sample line is {"key", "url" (basename of __url__), "fields": [[name, sha256, size]]}
with fields in the order the library holds them (bytes that are not UTF-8 in names
shown as U+FFFD); with --decode it also has "decoded":
{name: description of the decoded value}.
"""

import argparse
import hashlib
import json
import os
import sys
import warnings

import webdataset as wds


def describe(value):
    """A JSON description of a decoded field value."""
    if isinstance(value, (bytes, bytearray)):
        return {"type": "bytes", "sha256": hashlib.sha256(value).hexdigest()}
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, int):
        return {"type": "int", "value": value}
    if isinstance(value, str):
        return {"type": "str", "value": value}
    if isinstance(value, (dict, list)):
        return {"type": "json", "value": value}
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return {"type": "image", "size": list(value.size), "mode": value.mode}
    return {"type": type(value).__name__}


def sample_line(sample, decoded=None):
    fields = []
    for name, value in sample.items():
        if name.startswith("__"):
            continue
        name = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        fields.append([name, hashlib.sha256(value).hexdigest(), len(value)])
    # A name that is not UTF-8 reaches Python with surrogate escapes; print it with
    # replacement characters, as imgrun shows it.
    key = sample["__key__"].encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    line = {
        "key": key,
        "url": os.path.basename(sample["__url__"]),
        "fields": fields,
    }
    if decoded is not None:
        line["decoded"] = {
            name: describe(value) for name, value in decoded.items() if not name.startswith("__")
        }
    return line


def dataset(urls):
    return wds.WebDataset(urls, shardshuffle=False, empty_check=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["samples", "each"])
    parser.add_argument("--decode", default=None)
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    out = sys.stdout

    if args.mode == "samples":
        raw = iter(dataset(args.urls))
        decoded = iter(dataset(args.urls).decode(args.decode)) if args.decode else None
        for sample in raw:
            line = sample_line(sample, next(decoded) if decoded else None)
            out.write(json.dumps(line) + "\n")
        return

    for url in args.urls:
        samples, error = [], None
        try:
            for sample in dataset([url]):
                samples.append(sample_line(sample))
        except Exception as exn:  # the error is the result being compared
            error = f"{type(exn).__name__}: {exn.args[0] if exn.args else exn}"
        out.write(json.dumps({"url": url, "samples": samples, "error": error}) + "\n")


if __name__ == "__main__":
    main()
