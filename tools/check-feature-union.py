#!/usr/bin/env python3
"""Checks that the libtorch-free crates build their dependencies as the rest does.

`make test` builds `pipelines` and `runtime` once without libtorch (`cargo test -p
pipelines -p runtime`), then the binary and `actors` with it (`cargo test -p imgrun -p
actors`). Cargo turns on a dependency's features from the packages a command names, so a
dependency that the second command needs with one more feature (memchr's `default`,
serde_core's `default`, ...) is compiled twice, and so is every crate above it: quinn,
rustls, rhai, the image decoders and our own two crates. `runtime`'s dev-dependencies
turn those features on in the first command too (its `[dev-dependencies]` under "the
same features as the libtorch build"). This check fails, naming the crate and the
features, when the two commands would build a shared dependency differently, so the list
stays complete as dependencies change.
"""

import subprocess
import sys


def features(*packages: str) -> dict[str, set[str]]:
    """Each target crate (no build scripts, no proc macros) with its features, as cargo
    would build it for `cargo test -p PACKAGE...`."""
    args = ["cargo", "tree", "--locked", "-e", "normal,dev,no-proc-macro", "--prefix", "none"]
    args += ["-f", "{p}|{f}"]
    for package in packages:
        args += ["-p", package]
    try:
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"check-feature-union: `{' '.join(args)}` failed:\n{e.stderr}")
    crates: dict[str, set[str]] = {}
    for line in out.splitlines():
        line = line.removesuffix(" (*)").strip()
        if "|" not in line:
            continue
        crate, feats = line.split("|", 1)
        crates.setdefault(crate.strip(), set()).add(feats)
    return crates


def main() -> int:
    without = features("pipelines", "runtime")
    with_torch = features("imgrun", "actors")
    differ = [
        (crate, without[crate], with_torch[crate])
        for crate in sorted(without.keys() & with_torch.keys())
        if without[crate] != with_torch[crate]
    ]
    def shown(sets: set[str]) -> str:
        return " and ".join(f"[{f}]" if f else "[no features]" for f in sorted(sets))

    for crate, a, b in differ:
        print(
            f"check-feature-union: {crate} is built with {shown(a)} by "
            f"`cargo test -p pipelines -p runtime` and {shown(b)} by `cargo test -p "
            "imgrun -p actors`: add what is missing to runtime/Cargo.toml's "
            "dev-dependencies (the same features as the libtorch build)",
            file=sys.stderr,
        )
    if differ:
        return 1
    print(
        f"check-feature-union: the {len(without.keys() & with_torch.keys())} dependencies "
        "shared by the libtorch-free and the libtorch builds are built once"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
