"""``linepack demo``: the main job on the built-in default.

Profile VFS-mix on Debian's 6.1 cloud vmlinux in QEMU, relayout it, verify
the result against the original, boot it, and print the before/after table.
Each step runs the same ``linepack`` verb a user would, printed first, so the
demo doubles as a recipe.
"""

import os
import shlex
import subprocess
import sys
import time

from ..cli import verb
from ..errors import ExternalToolError
from ..progress import stderr_log
from .. import targets


def _step(title, argv, capture=False):
    cmd = ["linepack", *map(str, argv)]
    print(f"\n== {title}\n$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "linepack", *map(str, argv)],
                       stdout=subprocess.PIPE if capture else None, text=True)
    if capture and p.stdout:
        sys.stdout.write(p.stdout)
    print(f"   ({time.time() - t0:.1f} s, exit {p.returncode})", flush=True)
    return p


@verb("demo", "the main job: profile VFS-mix on Debian's vmlinux, relayout, verify, boot, compare")
class Demo:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--kernel", metavar="VMLINUX", help="kernel to optimise (default: Debian's "
                       "6.1 cloud vmlinux, fetched and cached)")
        p.add_argument("--abi", type=int, help="pin the Debian kernel ABI (e.g. 56)")
        p.add_argument("--strategy", default="pack,blocks",
                       help="layout strategy, or several comma-separated: each is rewritten, "
                       "verified, booted and shown side by side (default pack,blocks: whole "
                       "functions beside block level)")
        p.add_argument("--loops", type=int, default=2000, help="VFS-mix iterations (default 2000)")
        p.add_argument("--cache", action="append", metavar="MODEL",
                       help="L1i model(s) for the table (repeat; default: intel-32k-8w and "
                       "amd-64k-2w, measured in the same boots)")
        p.add_argument("--workdir", help="where outputs go (default: <cache>/demo)")

    @staticmethod
    def run(args):
        work = args.workdir or os.path.join(targets.cache_dir(), "demo")
        os.makedirs(work, exist_ok=True)
        kernel = args.kernel or targets.debian_vmlinux(
            args.abi, log=stderr_log("linepack"))
        print(f"kernel: {kernel}\noutputs: {work}")
        failed = []
        if _step("verify the original", ["verify", "-q", kernel]).returncode:
            failed.append("verify original")
        prof = os.path.join(work, "vfs-mix.profile")
        if _step("profile VFS-mix under QEMU TCG + linepack plugin",
                 ["profile", "--kernel", kernel, "--workload", "vfs-mix", "--loops", args.loops,
                  "-o", prof]).returncode:
            raise ExternalToolError("profiling failed; see above")
        kernels = [f"stock={kernel}"]
        for strategy in [x.strip() for x in str(args.strategy).split(",") if x.strip()]:
            out = os.path.join(work, f"vmlinux.{strategy}")
            r = _step(f"relayout with '{strategy}'",
                      ["relayout", kernel, "--profile", prof, "--strategy", strategy,
                       "-o", out, "--system-map", out + ".System.map",
                       "--layout-map", out + ".layout"])
            if r.returncode:
                failed.append(f"relayout {strategy}")
                continue
            if _step("verify the new image against the original",
                     ["verify", "-q", out, "--against", kernel]).returncode:
                failed.append(f"verify --against ({strategy})")
            if _step("boot the new image and run VFS-mix",
                     ["boot", "--kernel", out, "--workload", "vfs-mix",
                      "--loops", min(args.loops, 200)]).returncode:
                failed.append(f"boot ({strategy})")
            kernels.append(f"{strategy}={out}")
        ev = ["evaluate", *sum((["--kernel", k] for k in kernels), []), "--workload", "vfs-mix",
              "--loops", args.loops,
              *sum((["--cache", c] for c in (args.cache or ["intel-32k-8w", "amd-64k-2w"])), []),
              "--json", os.path.join(work, "evaluate.json")]
        if _step("before/after: kernel-mode L1i under the cache model", ev).returncode:
            failed.append("evaluate")
        print("\n" + ("demo: all steps passed" if not failed else f"demo: FAILED steps: {', '.join(failed)}"))
        return 1 if failed else 0
