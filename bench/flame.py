"""py-spy's collapsed stacks (`--format raw`) → a flame graph SVG and a summary of the top frames.

One recording (made with `--threads`) gives both: the SVG to explore (hover a frame for its
samples), the summary to read at a glance: the samples of each thread, then where the event
loop's thread spends them, by function itself, by file, and by function with its callees.

    python bench/flame.py results/profile-stream50.raw     # writes .svg beside it, prints the summary
"""

from __future__ import annotations

import html
import re
import sys
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: its files are shown from here
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_TRIM = (
    re.compile(r"^.*/site-packages/"),
    re.compile(r"^.*/lib/python3\.\d+/"),
    re.compile("^" + re.escape(f"{ROOT}/")),
)


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append(([short(frame) for frame in stack.split(";")], int(count)))
    return stacks


def short(frame: str) -> str:
    """`func (/long/path/to/pkg/mod.py:123)` → `func (pkg/mod.py:123)`;
    `thread (1234): MainThread` → `thread MainThread` (threads add up across runs)."""
    if frame.startswith("thread ("):
        return "thread " + frame.partition("): ")[2]
    match = _FRAME.match(frame)
    if not match:
        return frame
    file = match["file"]
    for pattern in _TRIM:
        file = pattern.sub("", file)
    return f"{match['func']} ({file}{':' + match['line'] if match['line'] else ''})"


def function(frame: str) -> str:
    """A frame without its line number, so one function's samples add up."""
    return re.sub(r":\d+\)$", ")", frame)


def summary(stacks: list[tuple[list[str], int]], top: int = 15) -> str:
    total = sum(count for _, count in stacks) or 1
    threads: Counter[str] = Counter()
    for frames, count in stacks:
        threads[frames[0] if frames[0].startswith("thread ") else "thread ?"] += count
    loop = [(f[1:], n) for f, n in stacks if f[0] == "thread MainThread" and len(f) > 1] or stacks
    loop_total = sum(count for _, count in loop) or 1
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    for frames, count in loop:
        leaf = function(frames[-1])
        own[leaf] += count
        by_file[leaf.rpartition(" (")[2].rstrip(")")] += count
        for name in {function(f) for f in frames}:
            inclusive[name] += count

    def table(title: str, counter: Counter[str], of: int, n: int = top) -> list[str]:
        rows = [title, "", "| % | samples | frame |", "| ---: | ---: | --- |"]
        rows += [f"| {100 * c / of:.1f} | {c} | `{name}` |" for name, c in counter.most_common(n)]
        return rows + [""]

    lines = [f"{total} samples, every thread (a sample is one thread seen running; idle threads are left out).", ""]
    lines += table("Samples by thread:", threads, total)
    lines += [f"The event loop's thread (MainThread), {loop_total} samples; percentages are of these.", ""]
    lines += table("Own time (the frame itself was running):", own, loop_total)
    lines += table("Own time by file:", by_file, loop_total)
    lines += table("Inclusive time (the frame or its callees):", inclusive, loop_total, top + 10)
    return "\n".join(lines)


def svg(stacks: list[tuple[list[str], int]], title: str, width: int = 1400, row: int = 17) -> str:
    root: dict = {"count": 0, "children": {}}
    depth = 0
    for frames, count in stacks:
        node = root
        node["count"] += count
        depth = max(depth, len(frames))
        for frame in frames:
            node = node["children"].setdefault(frame, {"count": 0, "children": {}})
            node["count"] += count
    total = root["count"] or 1
    height = (depth + 3) * row
    scale = (width - 20) / total
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="11">',
        f'<rect width="100%" height="100%" fill="#fafafa"/><text x="10" y="{row - 4}" font-size="13">'
        f"{html.escape(title)} ({total} samples; hover a frame)</text>",
    ]

    def draw(node: dict, x: float, level: int) -> None:
        for name, child in sorted(node["children"].items()):
            w = child["count"] * scale
            if w >= 0.3:
                y = height - (level + 1) * row
                hue = 20 + zlib.crc32(name.rpartition(" (")[2].encode()) % 40
                label = name if len(name) * 6.6 < w else name[: max(0, int(w / 6.6) - 2)] + ".."
                pct = 100 * child["count"] / total
                out.append(
                    f"<g><title>{html.escape(name)}: {child['count']} samples, {pct:.1f}%</title>"
                    f'<rect x="{10 + x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
                    f'fill="hsl({hue},85%,{55 + level % 3 * 5}%)"/>'
                    + (f'<text x="{13 + x:.1f}" y="{y + row - 5}">{html.escape(label)}</text>' if w > 20 else "")
                    + "</g>"
                )
                draw(child, x, level + 1)
            x += w

    draw(root, 0.0, 0)
    out.append("</svg>")
    return "\n".join(out)


def render(raw: Path, title: str) -> tuple[Path, str]:
    """Write `raw` as an SVG beside it; return the SVG's path and the summary."""
    stacks = read_stacks(raw)
    out = raw.with_suffix(".svg")
    out.write_text(svg(stacks, title))
    return out, summary(stacks)


if __name__ == "__main__":
    path, text = render(Path(sys.argv[1]), Path(sys.argv[1]).stem)
    print(text)
    print(f"flame graph: {path}")
