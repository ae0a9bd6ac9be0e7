#!/usr/bin/env python3
"""The source tree's layers (../shared/DESIGN.md, "Layers"): each folder under src/ may
include only from itself and the folders listed before it. Exits 1 naming every include
that reaches a later layer, except the ones below, which say why.

    tests/check_layers.py [SRC_DIR]
"""
import pathlib
import re
import sys

LAYERS = ["core", "ops", "comm", "nn", "parallel", "optim", "data", "plan", "train", "cli"]

# (including file, included file): why the later layer is read.
ALLOWED = {
    ("plan/search.h", "train/config.h"):
        "the planner weighs a training configuration and refuses a layout with the engine's own "
        "configuration checks, word for word",
}


def main():
    src = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent / "src")
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad, seen = [], set()
    for path in sorted(src.rglob("*")):
        if path.suffix not in {".h", ".cpp", ".cu", ".cuh"}:
            continue
        rel = path.relative_to(src).as_posix()
        layer = rel.split("/")[0]
        if layer not in rank:
            bad.append(f"{rel}: in no layer (the layers: {', '.join(LAYERS)})")
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"([a-z_]+)/([^"]+)"', line)
            if not m or m.group(1) not in rank or rank[m.group(1)] <= rank[layer]:
                continue
            target = f"{m.group(1)}/{m.group(2)}"
            if (rel, target) in ALLOWED:
                seen.add((rel, target))
                continue
            bad.append(f"{rel}:{n}: includes {target}: {m.group(1)} comes after {layer}")
    for pair in sorted(set(ALLOWED) - seen):
        bad.append(f"{pair[0]} no longer includes {pair[1]}: remove it from ALLOWED")
    for b in bad:
        print(b)
    print(f"check_layers: {len(bad)} problem{'s' if len(bad) != 1 else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
