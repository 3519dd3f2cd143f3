"""Builds tar files with Python's `tarfile` from a JSON spec on standard input.

    tar_build.py < spec.json

The spec is a list of {"path", "format": "gnu"|"pax"|"ustar", "members": [...]} (gzip
compressed when the path ends in `.gz`), each member {"name", "type": "file"|"dir"|
"oldfile"|"symlink"|"hardlink"|"contiguous"|"fifo", "data": text, "target": link
target}; "name_hex" instead of "name" gives a name's raw bytes (which need not be
UTF-8). Regular and contiguous members hold `data` as UTF-8.
"""

import io
import json
import sys
import tarfile

TYPES = {
    "file": tarfile.REGTYPE,
    "oldfile": tarfile.AREGTYPE,
    "contiguous": tarfile.CONTTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "fifo": tarfile.FIFOTYPE,
}
FORMATS = {"gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT, "ustar": tarfile.USTAR_FORMAT}


def main():
    for spec in json.load(sys.stdin):
        mode = "w:gz" if spec["path"].endswith(".gz") else "w"
        with tarfile.open(
            spec["path"], mode, format=FORMATS[spec["format"]], errors="surrogateescape"
        ) as tar:
            for member in spec["members"]:
                if "name_hex" in member:
                    name = bytes.fromhex(member["name_hex"]).decode("utf-8", "surrogateescape")
                else:
                    name = member["name"]
                info = tarfile.TarInfo(name)
                info.type = TYPES[member.get("type", "file")]
                info.mtime = 1704067200
                info.mode = 0o644
                data = member.get("data", "").encode("utf-8")
                if info.isreg():
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    info.linkname = member.get("target", "")
                    tar.addfile(info)


if __name__ == "__main__":
    main()
