"""``linepack boot``: boot a kernel under QEMU with a workload as /init, print its result line."""

import sys

from ..cli import verb


@verb("boot", "boot a kernel under QEMU (TCG) with a workload as /init; print its result line")
class Boot:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--kernel", required=True, metavar="VMLINUX",
                       help="the vmlinux (PVH entry) or bzImage (Linux boot protocol: the "
                       "decompressor runs, KASLR with RDRAND entropy) to boot")
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
        p.add_argument("--kallsyms", metavar="NAMES", default="",
                       help="comma-separated symbols whose /proc/kallsyms lines the guest "
                       "prints (a bzImage's _text is always shown, with the KASLR offset)")
        p.add_argument("-v", "--verbose", action="store_true",
                       help="print the QEMU command and the whole serial output")

    @staticmethod
    def run(args):
        from ..errors import BadInput, ExternalToolError
        from ..profile import qemu
        from ..io import OutputSet
        if args.loops is not None and args.loops < 0:
            raise BadInput("--loops must be >= 0")
        bz = qemu.check_kernel_path(args.kernel) == "bzimage"
        names = [n for n in args.kallsyms.split(",") if n]
        if bz and "_text" not in names:
            names.insert(0, "_text")
        if len(",".join(names)) > 1500:
            raise BadInput("--kallsyms: too many names for the kernel command line")
        env = {"lp_kallsyms": ",".join(names)} if names else None
        with OutputSet(inputs=[args.kernel], outputs={"--serial": args.serial}) as outs:
            from ..profile.runner import SYSTEM, QemuJob, run_job
            try:
                res = run_job(QemuJob(SYSTEM, args.kernel, workload=args.workload,
                                      loops=args.loops, icount=args.icount,
                                      timeout=args.timeout, serial_log=args.serial,
                                      append=args.append, env=env))
            except ExternalToolError:
                outs.commit()      # a failed boot's serial log is the one worth keeping
                raise
        if args.verbose:
            print(" ".join(res.command), file=sys.stderr)
            sys.stderr.write(res.serial)
        print(res.result_line)
        if names:
            from ..ship import kaslr
            for name, rows in sorted(kaslr.kallsyms_lines(res.serial).items()):
                for addr, typ in rows:
                    print(f"kallsyms {addr:016x} {typ} {name}")
        if bz:
            from ..ship import kaslr
            off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(args.kernel))
            print("kaslr offset " + ("unknown (no _text in /proc/kallsyms)" if off is None
                                     else f"{off:#x}"))
        print(f"wall {res.wall:.2f} s ({'icount' if args.icount else 'no icount'})")
        return 0
