"""``linepack fetch``: download and cache Debian's 6.1 cloud vmlinux."""

from ..cli import verb
from .. import targets


@verb("fetch", "download (once) and cache Debian's 6.1 cloud vmlinux; print its path")
class Fetch:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--abi", type=int, help="pin an ABI number, e.g. 56 for 6.1.0-56 "
                       "(default: the newest apt knows; env LINEPACK_KERNEL_ABI)")
        p.add_argument("--list", action="store_true", help="list the ABIs apt knows and exit")

    @staticmethod
    def run(args):
        if args.list:
            for abi in targets.available_abis():
                print(targets.release(abi))
            return 0
        targets.main_fetch(args.abi)
        return 0
