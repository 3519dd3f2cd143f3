#!/usr/bin/env python3
"""Circles among the files of one folder: CI fails on a new one.

In every folder of Rust sources (`runtime/src/actor`, `actors/src/job`, ...), each child
module (a file `x.rs`, or a folder `x/` with everything in it) is a node; a node depends
on a sibling when one of its files names that sibling or an item the folder's `mod.rs`
(or `lib.rs`/`main.rs`) re-exports from it, through `use` or an inline path (`super::`,
`crate::`, `self::`). The folder's own `mod.rs` is not a node: it declares and re-exports
its children, so it sits above them all. A circle is a strongly connected set of two or
more nodes.

Each circle found must lie within one of the circles `tools/circles.allow` names for that
folder (the circles the code had when the check came; the list only shrinks). A new
circle, or one that grew, fails the check and names the files and the lines that close
it. An allowed circle that is gone, or smaller now, is reported so that the list can be
tightened.

    python3 tools/check-circles.py            # check
    python3 tools/check-circles.py --list     # print every circle, in the allow format
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOW = ROOT / "tools" / "circles.allow"
# Crate source roots, and the file that is the crate's root module.
CRATES = [
    ("src", "main.rs"),
    ("runtime/src", "lib.rs"),
    ("actors/src", "lib.rs"),
    ("pipelines/src", "lib.rs"),
]

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
INLINE = re.compile(rf"\b((?:(?:super|self|crate)::)+(?:{IDENT}::)*{IDENT})")
USE = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]*);", re.S)
CFG_TEST = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*mod\s+tests\s*\{")


# Comments, raw strings, strings and char literals, whichever starts first.
LEXEMES = re.compile(
    r"//[^\n]*"
    r"|/\*.*?\*/"
    r'|(?<![A-Za-z0-9_])b?r(#*)".*?"\1'
    r'|b?"(?:\\.|[^"\\])*"'
    r"|'(?:\\.|[^'\\\n])'",
    re.S,
)


def strip(text):
    """The code without comments, strings and test modules (tests may use anything)."""
    # One pass, left to right, so that whatever opens first wins: the `r"` at the end of
    # "trainer-monitor" is inside a string, not a raw string's start.
    text = LEXEMES.sub(lambda m: '""' if m.group(0)[-1] in "\"#" else "", text)
    match = CFG_TEST.search(text)
    if match:
        text = text[: match.start()]
    return text


def use_paths(tree):
    """The paths a `use` tree names: `a::{b, c::{d, e as f}}` gives a::b, a::c::d, a::c::e."""
    tree = re.sub(r"\s+", " ", tree)
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree).strip()
    out = []

    def walk(prefix, text):
        depth, start, parts = 0, 0, []
        for i, ch in enumerate(text):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(text[start:i])
                start = i + 1
        parts.append(text[start:])
        for part in parts:
            if not part:
                continue
            brace = part.find("{")
            if brace >= 0 and part.endswith("}"):
                head = part[:brace].rstrip(":")
                walk(prefix + [s for s in head.split("::") if s], part[brace + 1 : -1])
            else:
                name = part.split(" as ")[0]
                out.append(prefix + [s for s in name.split("::") if s])

    walk([], tree)
    return out


def module_path(crate_dir, root_file, file):
    rel = file.relative_to(crate_dir)
    parts = list(rel.parts)
    if parts == [root_file]:
        return []
    last = parts[-1]
    if last == "mod.rs":
        parts = parts[:-1]
    else:
        parts[-1] = last[: -len(".rs")]
    return parts


def absolute(path, here):
    """`path` (segments) named in a file whose module is `here`, from the crate root."""
    out = list(here)
    segments = list(path)
    if segments and segments[0] == "crate":
        return segments[1:]
    if segments and segments[0] == "self":
        segments = segments[1:]
    elif segments and segments[0] != "super":
        return None  # an outside crate, or a name in scope
    while segments and segments[0] == "super":
        if not out:
            return None
        out.pop()
        segments = segments[1:]
    return out + segments


def reexports(root_text):
    """Names a folder's root file re-exports (`pub use x::...::Name`): name -> child x."""
    names = {}
    for match in USE.finditer(root_text):
        for path in use_paths(match.group(1)):
            if path and path[0] in ("self",):
                path = path[1:]
            if len(path) >= 2 and not path[0] in ("crate", "super", "std"):
                names[path[-1]] = path[0]
    return names


def folders():
    for crate, root_file in CRATES:
        crate_dir = ROOT / crate
        for folder in sorted({p.parent for p in crate_dir.rglob("*.rs")}):
            if folder.name in ("tests", "benches", "examples", "bin"):
                continue
            own = folder / (root_file if folder == crate_dir else "mod.rs")
            if not own.exists():
                own = folder.parent / f"{folder.name}.rs"
            yield crate_dir, root_file, folder, own


def graph(crate_dir, root_file, folder, own):
    here = module_path(crate_dir, root_file, own) if own.exists() else None
    if here is None:
        return {}, {}
    children = {}
    for entry in folder.iterdir():
        if entry.suffix == ".rs" and entry != own and not entry.name.endswith("_tests.rs"):
            children[entry.stem] = [entry]
        elif entry.is_dir() and any(entry.rglob("*.rs")):
            children.setdefault(entry.name, [])
            children[entry.name] += sorted(entry.rglob("*.rs"))
    # A folder `x/` beside `x.rs` is the same module.
    names = reexports(strip(own.read_text())) if own.exists() else {}
    edges, why = {c: set() for c in children}, {}
    for child, files in children.items():
        for file in files:
            text = strip(file.read_text())
            mod = module_path(crate_dir, root_file, file)
            paths = [p for m in USE.finditer(text) for p in use_paths(m.group(1))]
            paths += [m.group(1).split("::") for m in INLINE.finditer(text)]
            for path in paths:
                full = absolute(path, mod)
                if full is None or full[: len(here)] != here or len(full) <= len(here):
                    continue
                first = full[len(here)]
                target = first if first in children else names.get(first)
                if target and target != child and target in children:
                    edges[child].add(target)
                    why.setdefault((child, target), f"{file.relative_to(ROOT)}: {'::'.join(path)}")
    return edges, why


def circles(edges):
    """Strongly connected sets of two or more nodes (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def found():
    result = []
    for crate_dir, root_file, folder, own in folders():
        edges, why = graph(crate_dir, root_file, folder, own)
        for group in circles(edges):
            result.append((str(folder.relative_to(ROOT)), group, edges, why))
    return result


def allowed():
    allow = {}
    if ALLOW.exists():
        for line in ALLOW.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                folder, _, members = line.partition(":")
                allow.setdefault(folder.strip(), []).append(set(members.split()))
    return allow


def main():
    seen = found()
    if "--list" in sys.argv:
        for folder, group, _, _ in seen:
            print(f"{folder}: {' '.join(group)}")
        return 0
    allow = allowed()
    bad = []
    for folder, group, edges, why in seen:
        if not any(set(group) <= a for a in allow.get(folder, [])):
            bad.append((folder, group, edges, why))
    for folder, group, edges, why in bad:
        print(f"new circle among the files of {folder}: {' '.join(group)}")
        for a in group:
            for b in sorted(edges[a] & set(group)):
                print(f"  {a} -> {b}  ({why[(a, b)]})")
    now = {}
    for folder, group, _, _ in seen:
        now.setdefault(folder, []).append(set(group))
    for folder, groups in sorted(allow.items()):
        for group in groups:
            if not any(g == group for g in now.get(folder, [])):
                print(f"note: {folder}: {' '.join(sorted(group))} is smaller or gone; "
                      f"tighten tools/circles.allow")
    total = len(seen)
    print(f"{total} circle(s) among the files of one folder, {len(bad)} not allowed")
    if bad:
        print("move what both sides need into a leaf file, and say the folder's layers "
              "in its module doc (STYLE.md)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
