"""Times raw iteration (no decoding) over shards with the Python `webdataset` library.

    wds_iterate.py RUNS URL...

Reads every shard once to warm the page cache, then iterates
`webdataset.WebDataset(urls, shardshuffle=False)` RUNS times in this one thread and prints
one JSON line: {"version", "runs": [seconds...], "samples", "payload_bytes"}.
Used by `pipelines/benches/read.rs`.
"""

import json
import sys
import time
import warnings

import webdataset as wds


def main():
    runs, urls = int(sys.argv[1]), sys.argv[2:]
    warnings.simplefilter("ignore")
    for url in urls:
        with open(url, "rb") as f:
            while f.read(1 << 20):
                pass
    times, samples, payload = [], 0, 0
    for _ in range(runs):
        samples, payload = 0, 0
        start = time.perf_counter()
        for sample in wds.WebDataset(urls, shardshuffle=False):
            samples += 1
            for name, value in sample.items():
                if not name.startswith("__"):
                    payload += len(value)
        times.append(time.perf_counter() - start)
    print(json.dumps({"version": wds.__version__, "runs": times, "samples": samples, "payload_bytes": payload}))


if __name__ == "__main__":
    main()
