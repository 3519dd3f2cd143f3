"""Copies shards sample by sample with the Python `webdataset` library, as a user's own
pipeline writes them: read with WebDataset (no decoding), written with ShardWriter, and
no manifest.

    wds_copy.py OUTPATTERN MAXCOUNT URL...

OUTPATTERN is a ShardWriter pattern such as /data/py-%06d.tar. Prints the number of
samples written.
"""

import sys

import webdataset as wds


def main():
    pattern, maxcount, urls = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    written = 0
    with wds.ShardWriter(pattern, maxcount=maxcount, verbose=0) as sink:
        for sample in wds.WebDataset(urls, shardshuffle=False):
            sink.write(
                {
                    name: value
                    for name, value in sample.items()
                    if name == "__key__" or not name.startswith("__")
                }
            )
            written += 1
    print(written)


if __name__ == "__main__":
    main()
