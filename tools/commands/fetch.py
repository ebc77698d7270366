"""``linepack fetch``: download and cache a Debian kernel (6.1, 6.12, 7.3; cloud,
generic or rt)."""

from ..cli import verb
from .. import targets


@verb("fetch", "download (once) and cache a Debian kernel (--series 6.1, 6.12, 7.2 or 7.3; "
      "--flavour cloud, generic or rt): print the path of its vmlinux (or --vmlinuz)")
class Fetch:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--series", default=targets.DEFAULT_SERIES, choices=list(targets.SERIES_TABLE),
                       help="kernel series: 6.1 (default, Debian 12, linux-image-6.1.0-<ABI>-cloud-amd64-dbg), "
                       "6.12 (Debian 13, linux-image-6.12.<N>+deb13-cloud-amd64-dbg), 7.3 or 7.2 "
                       "(trixie-backports, linux-image-7.3.<N>+deb13-cloud-amd64-dbg) or 6.12-deb12 "
                       "(bookworm-backports); Debian 13's packages come through a private apt "
                       "state under the cache, the machine's apt sources are not touched")
        p.add_argument("--flavour", default=targets.DEFAULT_FLAVOUR, choices=list(targets.FLAVOURS),
                       help="cloud (default: -cloud-amd64, the reference kernel of linepack's "
                       "tests), generic (-amd64, what most machines run) or rt (-rt-amd64, "
                       "PREEMPT_RT)")
        p.add_argument("--abi", type=int, help="pin an ABI number, e.g. 56 for 6.1.0-56, or the patch "
                       "level for 6.12/7.x, e.g. 118 for 6.12.118+deb13 (default: the newest apt knows; "
                       "env LINEPACK_KERNEL_ABI, LINEPACK_KERNEL_ABI_6_12, LINEPACK_KERNEL_ABI_7_3, "
                       "..._7_2)")
        p.add_argument("--list", action="store_true", help="list the releases apt knows and exit")
        p.add_argument("--update", action="store_true",
                       help="refresh the private apt lists first (Debian 13 series: a new point release)")
        p.add_argument("--vmlinuz", action="store_true",
                       help="fetch the boot image (vmlinuz) of the build instead of the -dbg "
                       "vmlinux, and print its path")
        p.add_argument("--module", action="append", metavar="PATH",
                       help="also cache this module of the same build (path under "
                       "lib/modules/<release>/kernel/, e.g. fs/fat/vfat.ko; repeat) and print "
                       "its path (Debian 13's .ko.xz are cached decompressed)")

    @staticmethod
    def run(args):
        fl = args.flavour
        s = targets.series_info(args.series, fl)
        if args.update:
            if s.apt is None:
                from ..errors import BadInput
                raise BadInput(f"--update: series {args.series} uses the machine's apt "
                               "(run apt-get update)")
            targets.update_apt_state(s.apt)
        if args.list:
            for abi in targets.available_abis(args.series, fl):
                print(targets.release(abi, args.series, fl))
            return 0
        if args.vmlinuz:
            print(targets.debian_vmlinuz(args.abi, log=targets._log, series=args.series,
                                         flavour=fl))
        else:
            targets.main_fetch(args.abi, series=args.series, flavour=fl)
        for m in args.module or ():
            print(targets.debian_module(m, abi=args.abi, log=targets._log, series=args.series,
                                        flavour=fl))
        return 0
