"""The top of a sampling profile: frames by own samples and by samples they are on the stack of.

    python benchmarks/tools/collapsed_top.py FILE [--top 25] [--threads]

FILE holds collapsed stacks, one `frame;frame;...;leaf COUNT` line per distinct stack (what `py-spy record
--format raw` writes; `--threads` keeps py-spy's per-thread root frames apart). Prints, per file, the share
of samples each frame holds as the leaf (own) and anywhere on the stack (inclusive, counted once per stack),
highest first: where a process's interpreter time goes under load. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
from collections import Counter


def top(path: str, num: int) -> str:
    """The report for one collapsed-stack file."""
    own, inclusive, threads = Counter(), Counter(), Counter()
    total = 0
    with open(path, errors="replace") as file:  # a process title may hold bytes that are not UTF-8
        for line in file:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            samples = int(count)
            frames = stack.split(";")
            total += samples
            root = frames[0][:80]  # with --subprocesses py-spy's first frame is the process, then the thread
            if frames[0].startswith("process ") and len(frames) > 1:
                root += " / " + frames[1]
            threads[root] += samples
            own[frames[-1]] += samples
            for frame in set(frames):
                inclusive[frame] += samples
    if not total:
        return f"{path}: no samples"
    lines = [f"{path}: {total} samples"]
    for title, counter in (("roots (threads or processes)", threads), ("own", own), ("inclusive", inclusive)):
        lines.append(f"  {title}:")
        lines += [f"    {100 * n / total:5.1f}%  {frame}" for frame, n in counter.most_common(num)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.files:
        print(top(path, args.top))


if __name__ == "__main__":
    main()
