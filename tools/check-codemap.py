#!/usr/bin/env python3
"""ARCHITECTURE.md is checkable: its code map names every source file, and every test its
invariants name exists. CI fails on either.

Code map: a file counts as named when ARCHITECTURE.md has it in backticks, by a path that
ends with it (`job/steps.rs`), or by its file name alone (`steps.rs`) where no other
source file has that name. A crate's `lib.rs`/`main.rs` and a folder's `mod.rs` are named
by their folder's section and need no line of their own.

Invariants: every list item that begins `- Architecture invariant:` (one line each) has
`Held by:` and, after it, either `no test yet` or one or more items in backticks:
- `path/to/file.rs::name`: a test; `fn name` must be in that file (a test in a source
  file's `mod tests` counts). The path is relative to the repository root and exact: a
  test that moves must be named where it is now.
- `path/to/file` with no `::`: a check that is not a Rust test (`tools/check-deps.sh`);
  the file must exist.
It prints how many invariants there are and how many have no test yet.

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


INVARIANT = "Architecture invariant:"
HELD_BY = "Held by:"
NO_TEST = "no test yet"


def defines(path, name):
    """Whether the Rust file at `path` has `fn name`."""
    pattern = re.compile(r"\bfn\s+" + re.escape(name) + r"\b")
    try:
        return bool(pattern.search(path.read_text(errors="replace")))
    except OSError:
        return False


def check_invariants(text):
    """(problems, invariants, without a test) for ARCHITECTURE.md's invariant lines."""
    problems, count, untested = [], 0, 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("- " + INVARIANT):
            continue
        count += 1
        where = f"ARCHITECTURE.md:{number}"
        if HELD_BY not in line:
            problems.append(f"{where}: an invariant without `{HELD_BY}`: {line.strip()}")
            continue
        held = line.split(HELD_BY, 1)[1]
        items = re.findall(r"`([^`]+)`", held)
        if NO_TEST in held and not items:
            untested += 1
            continue
        if not items:
            problems.append(f"{where}: `{HELD_BY}` names no test and does not say "
                            f"`{NO_TEST}`")
            continue
        for item in items:
            if "::" not in item:
                if not (ROOT / item).is_file():
                    problems.append(f"{where}: {item} does not exist")
                continue
            path, name = item.split("::", 1)
            name = name.rsplit("::", 1)[-1]
            if not (ROOT / path).is_file():
                problems.append(f"{where}: {path} does not exist (named as {item})")
            elif not defines(ROOT / path, name):
                problems.append(f"{where}: no `fn {name}` in {path}")
    return problems, count, untested


def main():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    problems, count, untested = check_invariants(text)
    for problem in problems:
        print(problem)
    print(f"check-codemap: {count} invariants, {count - untested} held by a test or check, "
          f"{untested} with no test yet, {len(problems)} naming a missing test or check")
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
    return 1 if missing or problems else 0


if __name__ == "__main__":
    sys.exit(main())
