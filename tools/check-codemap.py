#!/usr/bin/env python3
"""ARCHITECTURE.md's code map names every source file: CI fails on one it does not.

A file counts as named when ARCHITECTURE.md has it in backticks, by a path that ends with
it (`job/steps.rs`), or by its file name alone (`steps.rs`) where no other source file
has that name. A crate's `lib.rs`/`main.rs`
and a folder's `mod.rs` are named by their folder's section and need no line of their own.

    python3 tools/check-codemap.py
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("src/", "runtime/src/", "actors/src/", "pipelines/src/")
IMPLIED = {"lib.rs", "main.rs", "mod.rs"}


def files():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.rs"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    return sorted(f for f in listed if f.startswith(SOURCES) and (ROOT / f).exists())


def main():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([^`\s]+\.rs)`", text))
    paths = files()
    counts = {}
    for path in paths:
        counts[Path(path).name] = counts.get(Path(path).name, 0) + 1
    missing = []
    for path in paths:
        name = Path(path).name
        if name in IMPLIED:
            continue
        by_path = any(n != name and (path == n or path.endswith("/" + n)) for n in named)
        by_name = counts[name] == 1 and name in named
        if not (by_path or by_name):
            missing.append(path)
    for path in missing:
        print(f"ARCHITECTURE.md does not name {path}: add it to the code map")
    print(f"check-codemap: {len(paths)} source files, {len(missing)} not in the code map")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
