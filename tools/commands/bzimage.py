"""``linepack bzimage VMLINUX -o bzImage``: the boot image the kernel's own build makes;
``--vmlinuz VMLINUZ``: the distribution's own boot image with VMLINUX as its new payload."""

import os
import time

from ..cli import verb
from ..progress import stderr_log


@verb("bzimage", "make the bzImage of a (rewritten) vmlinux with the kernel's own build, or "
      "with --vmlinuz put it into the distribution's vmlinuz (relocations for KASLR included)")
class BzImage:
    @staticmethod
    def add_arguments(p):
        p.add_argument("vmlinux", help="the vmlinux (linked with --emit-relocs; relayout's output)")
        p.add_argument("-o", "--output", required=True, metavar="BZIMAGE", help="the bzImage to write")
        p.add_argument("--vmlinuz", metavar="VMLINUZ", help="the distribution's boot image of the "
                       "same build: keep its setup code and decompressor, replace its payload "
                       "(VMLINUX stripped as the kernel build strips it + the KASLR relocation "
                       "table mapped through the layout); no kernel source, no build")
        p.add_argument("--layout-map", metavar="TSV", help="with --vmlinuz: relayout's "
                       "--layout-map of VMLINUX (its .linepack.blockmap is read too); without "
                       "it VMLINUX must be the vmlinuz's own payload")
        p.add_argument("--grow-room", type=int, default=0, metavar="BYTES", help="with "
                       "--vmlinuz: move the decompressor up to give the payload at least BYTES "
                       "more room even when it fits (it moves anyway when it does not fit)")
        p.add_argument("--source", metavar="DIR", help="kernel source tree the vmlinux was built "
                       "from (default for a Debian vmlinux: its linux-source package, cached)")
        p.add_argument("--config", metavar="FILE", help="its .config (default for a Debian "
                       "vmlinux: /boot/config-<release> of its linux-image package)")
        p.add_argument("--relocs", metavar="FILE", help="also write the build's vmlinux.relocs")
        p.add_argument("-j", "--jobs", type=int, help="make jobs (default: the CPU count)")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    @staticmethod
    def run(args):
        from ..errors import BadInput
        from ..io import OutputSet
        from ..ship.bzimage import make_bzimage
        if args.vmlinuz:
            return BzImage.run_vmlinuz(args, log_of(args))
        if args.layout_map:
            raise BadInput("--layout-map applies to --vmlinuz")
        if args.grow_room:
            raise BadInput("--grow-room applies to --vmlinuz")
        if args.jobs is not None and args.jobs < 1:
            raise BadInput("--jobs must be >= 1")
        if args.source and not os.path.isdir(args.source):
            raise BadInput(f"{args.source}: no such source directory")
        if args.config and not os.path.isfile(args.config):
            raise BadInput(f"{args.config}: no such config file")
        log = stderr_log("bzimage", args.quiet)
        t0 = time.monotonic()
        # outputs checked before the (long) build; both appear together or not at all
        with OutputSet(inputs=[args.vmlinux, args.config],
                       outputs={"-o": args.output, "--relocs": args.relocs}):
            s = make_bzimage(args.vmlinux, args.output, source=args.source, config=args.config,
                             relocs_out=args.relocs, jobs=args.jobs, log=log)
        print(f"{s['bzimage']}: bzImage of {s['release']}, {s['size']:,} bytes "
              f"({time.monotonic() - t0:.1f} s{', tree prepared' if s['prepared_now'] else ''})")
        return 0

    @staticmethod
    def run_vmlinuz(args, log):
        from ..errors import BadInput
        from ..io import OutputSet
        from ..ship.vmlinuz import make_from_vmlinuz
        for opt in ("source", "config", "jobs"):
            if getattr(args, opt) is not None:
                raise BadInput(f"--{opt} applies to the kernel build, not to --vmlinuz")
        if args.grow_room < 0:
            raise BadInput("--grow-room must be >= 0")
        t0 = time.monotonic()
        with OutputSet(inputs=[args.vmlinux, args.vmlinuz, args.layout_map],
                       outputs={"-o": args.output, "--relocs": args.relocs}):
            s = make_from_vmlinuz(args.vmlinux, args.vmlinuz, args.output,
                                  layout_map=args.layout_map, log=log, relocs_out=args.relocs,
                                  grow_room=args.grow_room)
        counts = ", ".join(f"{n:,} {g}" for g, n in s["relocs"].items())
        print(f"{s['vmlinuz']}: {s['release']} boot image with a new payload, {s['size']:,} bytes "
              f"({s['compression']} {s['compressed']:,} of {s['room']:,} bytes of room"
              f"{', decompressor moved up by ' + format(s['moved'], ',') if s['moved'] else ''}; "
              f"relocations {counts}; {s['table']}; {time.monotonic() - t0:.1f} s)")
        return 0


def log_of(args):
    return stderr_log("bzimage", args.quiet)
