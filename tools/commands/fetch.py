"""``linepack fetch``: download and cache a Debian cloud vmlinux (6.1 or 6.12)."""

from ..cli import verb
from .. import targets


@verb("fetch", "download (once) and cache Debian's cloud vmlinux (--series 6.1 or 6.12); print its path")
class Fetch:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--series", default=targets.DEFAULT_SERIES, choices=sorted(targets.SERIES_TABLE),
                       help="kernel series: 6.1 (default, linux-image-6.1.0-<ABI>-cloud-amd64-dbg) or "
                       "6.12 (linux-image-6.12.<N>+deb12-cloud-amd64-dbg, bookworm-backports)")
        p.add_argument("--abi", type=int, help="pin an ABI number, e.g. 56 for 6.1.0-56, or the patch "
                       "level for 6.12, e.g. 117 for 6.12.117+deb12 (default: the newest apt knows; "
                       "env LINEPACK_KERNEL_ABI / LINEPACK_KERNEL_ABI_6_12)")
        p.add_argument("--list", action="store_true", help="list the releases apt knows and exit")
        p.add_argument("--module", action="append", metavar="PATH",
                       help="also cache this module of the same build (path under "
                       "lib/modules/<release>/kernel/, e.g. fs/fat/vfat.ko; repeat) and print "
                       "its path")

    @staticmethod
    def run(args):
        if args.list:
            for abi in targets.available_abis(args.series):
                print(targets.release(abi, args.series))
            return 0
        targets.main_fetch(args.abi, series=args.series)
        for m in args.module or ():
            print(targets.debian_module(m, abi=args.abi, series=args.series))
        return 0
