"""Benchmark: relayout wall time and peak RSS on the real vmlinux (run by hand).

    python3 tests/bench/bench_relayout.py [STRATEGY] [PROFILE]
"""

import json
import os
import resource
import sys
import tempfile
import time

from linepack.relayout.driver import load_profile, relayout

VMLINUX = os.path.expanduser("~/.cache/linepack/kernels/6.1.0-56-cloud-amd64/vmlinux")


def main():
    strategy = sys.argv[1] if len(sys.argv) > 1 else "pack"
    hot = load_profile(sys.argv[2])[0] if len(sys.argv) > 2 else {}
    with tempfile.TemporaryDirectory() as d:
        t = time.time()
        summary, _, _ = relayout(VMLINUX, os.path.join(d, "vmlinux"), strategy, hotness=hot)
        wall = time.time() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"strategy": strategy, "wall_s": round(wall, 1), "peak_rss_mb": round(rss),
                      "peak_child_rss_mb": round(kids),
                      "functions_moved": summary["functions_moved"],
                      "text_growth_bytes": summary["text_growth_bytes"],
                      "hot_lines": [summary["hot_lines_before"], summary["hot_lines_after"]]}))


if __name__ == "__main__":
    main()
