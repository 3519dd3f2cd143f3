#!/usr/bin/env python3
"""Long functions in the folders that must keep them short: CI fails on a new one.

A function is counted from the line of its `fn` to the line of its closing brace, test
modules (`#[cfg(test)] mod tests { ... }`) left out. Each folder in `LIMITS` has a
ceiling; a function over it fails the check unless `tools/fn-length.allow` names it with
a length it may not grow past (the list only shrinks).

    python3 tools/check-fn-length.py            # check
    python3 tools/check-fn-length.py --list     # every function in those folders, longest first
    python3 tools/check-fn-length.py --top N    # the N longest, in every crate
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOW = ROOT / "tools" / "fn-length.allow"
# Folder -> the most lines a function in it may have.
LIMITS = {"actors/src/job": 120}
CRATES = ["src", "runtime/src", "actors/src", "pipelines/src"]

FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)")
CFG_TEST = re.compile(r"^\s*#\[cfg\(test\)\]\s*$")


def strip(line):
    """The line without its comment, strings and char literals (enough for brace counts)."""
    out, i, n = [], 0, len(line)
    while i < n:
        c = line[i]
        if line.startswith("//", i):
            break
        if c == '"':
            i += 1
            while i < n and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
            i += 1
            continue
        if c == "'" and i + 2 < n and (line[i + 2] == "'" or (line[i + 1] == "\\" and "'" in line[i + 2 : i + 5])):
            i = line.index("'", i + 2) + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(path):
    """(name, first line, lines) of every function outside test modules, nested ones too."""
    lines = path.read_text().splitlines()
    found, stack, depth, skip_until = [], [], 0, None
    pending_test = False
    for number, raw in enumerate(lines, 1):
        code = strip(raw)
        if skip_until is not None:
            depth += code.count("{") - code.count("}")
            if depth <= skip_until:
                skip_until = None
            continue
        if CFG_TEST.match(raw):
            pending_test = True
            continue
        if pending_test and re.match(r"^\s*mod\s+\w+\s*\{", code):
            skip_until = depth
            depth += code.count("{") - code.count("}")
            pending_test = False
            continue
        pending_test = pending_test and not code.strip()
        m = FN.match(code)
        if m:
            stack.append([m.group(1), number, None])
        for ch in code:
            if ch == "{":
                depth += 1
                if stack and stack[-1][2] is None and stack[-1][1] <= number:
                    stack[-1][2] = depth
            elif ch == "}":
                if stack and stack[-1][2] == depth:
                    name, first, _ = stack.pop()
                    found.append((name, first, number - first + 1))
                depth -= 1
        if stack and stack[-1][2] is None and code.rstrip().endswith(";"):
            stack.pop()  # a declaration without a body (trait item, extern fn)
    return found


def sources(folder):
    return sorted((ROOT / folder).rglob("*.rs"))


def main():
    args = sys.argv[1:]
    if args[:1] == ["--top"]:
        count = int(args[1]) if len(args) > 1 else 20
        every = [(n, f"{p.relative_to(ROOT)}:{line} {name}") for c in CRATES for p in sources(c) for name, line, n in functions(p)]
        for n, where in sorted(every, reverse=True)[:count]:
            print(f"{n:5}  {where}")
        return 0
    allow = {}
    if ALLOW.exists():
        for raw in ALLOW.read_text().splitlines():
            raw = raw.split("#", 1)[0].strip()
            if raw:
                where, most = raw.rsplit(None, 1)
                allow[where] = int(most)
    failed, seen = 0, set()
    listing = []
    for folder, limit in LIMITS.items():
        for path in sources(folder):
            rel = path.relative_to(ROOT)
            for name, line, n in functions(path):
                listing.append((n, f"{rel}:{line} {name}"))
                if n <= limit:
                    continue
                key = f"{rel}::{name}"
                seen.add(key)
                if key in allow and n <= allow[key]:
                    if n < allow[key]:
                        print(f"check-fn-length: {key} is {n} lines now; tighten tools/fn-length.allow (says {allow[key]})")
                    continue
                failed += 1
                if args[:1] != ["--list"]:
                    print(    f"check-fn-length: {rel}:{line}: fn {name} is {n} lines, over {folder}'s {limit}",
                        file=sys.stderr,
                    )
    if args[:1] == ["--list"]:
        for n, where in sorted(listing, reverse=True):
            print(f"{n:5}  {where}")
        return 0
    for key in sorted(set(allow) - seen):
        print(f"check-fn-length: {key} is within its folder's limit now; drop it from tools/fn-length.allow")
    if failed:
        return 1
    print(f"check-fn-length: {len(listing)} functions in {', '.join(LIMITS)}, none over the limit ({len(allow)} allowed for now)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
