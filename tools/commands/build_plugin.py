"""``linepack build-plugin``: build the QEMU TCG plugin (once) and print its path."""

from ..cli import verb


@verb("build-plugin", "fetch qemu-plugin.h for the installed QEMU, build linepack's TCG plugin "
      "into the cache (only when its source or header changed); print the .so path")
class BuildPlugin:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--force", action="store_true", help="rebuild even if up to date")
        p.add_argument("--header", action="store_true",
                       help="only fetch qemu-plugin.h and print its path")

    @staticmethod
    def run(args):
        from ..profile import plugin_build
        if args.header:
            print(plugin_build.fetch_header())
            return 0
        print(plugin_build.build_plugin(force=args.force))
        return 0
