"""Benchmark: relayout --strategy blocks + verify --against on the real vmlinux.

    python3 tests/bench/bench_relayout_blocks.py [--profile P] [--runs 3] [--json FILE]

The same harness as bench_relayout.py (each step its own process, median of
``--runs`` with min..max, peak memory of the process tree, BOLT 19's in-place
rewrite of the same vmlinux timed in the same run as the anchor), with the
block-level strategy and the block-level issue's target: relayout + verify
--against together <= 30 s and <= 1.5 GB.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_relayout  # noqa: E402

bench_relayout.TARGET_WALL_S = 30.0
bench_relayout.TARGET_RSS_MB = 1536.0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--strategy" not in argv:
        argv += ["--strategy", "blocks"]
    return bench_relayout.main(argv)


if __name__ == "__main__":
    sys.exit(main())
