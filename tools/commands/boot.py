"""``linepack boot``: boot a kernel under QEMU with a workload as /init, print its result line."""

import sys

from ..cli import verb


@verb("boot", "boot a kernel under QEMU (TCG) with a workload as /init; print its result line")
class Boot:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--kernel", required=True, metavar="VMLINUX",
                       help="the vmlinux to boot (e.g. the path 'linepack fetch' prints)")
        p.add_argument("--workload", default="vfs-mix",
                       help="workload name from configs/workloads/ (default: vfs-mix)")
        p.add_argument("--loops", type=int, help="loop count (default: the workload's)")
        p.add_argument("--no-icount", dest="icount", action="store_false",
                       help="plain TCG: faster boots, but not repeatable instruction counts")
        p.add_argument("--timeout", type=float, default=600, metavar="S",
                       help="kill QEMU after S seconds (default: 600)")
        p.add_argument("--serial", metavar="FILE", help="also write the serial output to FILE")
        p.add_argument("--append", help="kernel command line instead of configs/kernel.toml's "
                       "(loops=N is added)")
        p.add_argument("-v", "--verbose", action="store_true",
                       help="print the QEMU command and the whole serial output")

    @staticmethod
    def run(args):
        from ..errors import BadInput, ExternalToolError
        from ..profile import qemu
        from ..io import OutputSet
        if args.loops is not None and args.loops < 0:
            raise BadInput("--loops must be >= 0")
        qemu.check_kernel_path(args.kernel)
        with OutputSet(inputs=[args.kernel], outputs={"--serial": args.serial}) as outs:
            try:
                res = qemu.run_workload(args.kernel, args.workload, loops=args.loops,
                                        icount=args.icount, timeout=args.timeout,
                                        log=args.serial, append=args.append)
            except ExternalToolError:
                outs.commit()      # a failed boot's serial log is the one worth keeping
                raise
        if args.verbose:
            print(" ".join(res.command), file=sys.stderr)
            sys.stderr.write(res.serial)
        print(res.result_line)
        print(f"wall {res.wall:.2f} s ({'icount' if args.icount else 'no icount'})")
        return 0
