"""``linepack kbuild``: build a kernel with linepack inside its build (the post-link
hook), for kernels that strip their relocations (6.5+)."""

import os
import time

from ..cli import verb
from ..progress import stderr_log


@verb("kbuild", "build a kernel with linepack in its post-link step (kernels >= 6.5 strip "
      "the relocations relayout needs right after it)")
class Kbuild:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--print-hook", action="store_true",
                       help="print the hook's path (for make ARCH_POSTLINK=...) and exit")
        src = p.add_mutually_exclusive_group()
        src.add_argument("--source", metavar="DIR", help="a clean kernel source tree (never "
                         "written: objects go to a cached object tree)")
        src.add_argument("--debian", metavar="linux-source-X.Y[=VERSION]",
                         help="Debian's kernel source package (fetched with apt, cached)")
        p.add_argument("--config", metavar="FILE", help="the kernel .config (e.g. "
                       "configs/kbuild/x86_64-small.config); must be relocatable x86-64")
        p.add_argument("--profile", metavar="P", help="a profile of this build's vmlinux "
                       "(same build-id); without it the stock layout is built")
        p.add_argument("--strategy", default="pack", help="relayout strategy (default: pack)")
        p.add_argument("--relayout-flags", default="", metavar="ARGS",
                       help="extra relayout arguments, one string")
        p.add_argument("-o", "--output", metavar="DIR", help="directory for bzImage, vmlinux, "
                       "vmlinux.orig, System.map, vmlinux.relocs, modules/ (a new directory, or "
                       "one an earlier kbuild wrote: replaced as a whole)")
        p.add_argument("-j", "--jobs", type=int, help="make jobs (default: the CPU count)")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    @staticmethod
    def run(args):
        from ..errors import BadInput
        from ..ship import kbuild
        if args.print_hook:
            print(kbuild.HOOK)
            return 0
        if not args.source and not args.debian:
            raise BadInput("kbuild needs --source DIR or --debian linux-source-X.Y[=VERSION]")
        if not args.config:
            raise BadInput("kbuild needs --config FILE")
        if not args.output:
            raise BadInput("kbuild needs -o DIR")
        if args.jobs is not None and args.jobs < 1:
            raise BadInput("--jobs must be >= 1")
        if not os.path.isfile(args.config):
            raise BadInput(f"{args.config}: no such config file")
        if args.profile and not os.path.isfile(args.profile):
            raise BadInput(f"{args.profile}: no such profile")
        if args.source and not os.path.isdir(args.source):
            raise BadInput(f"{args.source}: no such source directory")
        from ..ship.tree import check_config
        check_config(args.config)     # before any download or build
        if args.source:
            kbuild.kernel_version(args.source)          # a kernel tree at all
        kbuild.check_output_dir(args.output, inputs=(args.source, args.config, args.profile))
        log = stderr_log("kbuild", args.quiet)
        t0 = time.monotonic()
        src = args.source or kbuild.debian_source(args.debian, log=log)
        s = kbuild.kbuild(src, args.config, args.output, profile=args.profile,
                          strategy=args.strategy, relayout_flags=args.relayout_flags,
                          jobs=args.jobs, log=log)
        print(f"{s['out_dir']}: Linux {s['version']} "
              f"({'linepack ' + args.strategy if args.profile else 'stock layout'}), "
              f"{len(s['files'])} files, {len(s['modules'])} modules "
              f"({time.monotonic() - t0:.1f} s; object tree {s['build_dir']})")
        return 0
