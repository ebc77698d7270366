"""``linepack verify IMAGE [--against OLD]``: Capstone verification for CI.

Exit 0 = clean, 1 = findings (errors; warnings too with --strict), 2 = usage
or unreadable input.
"""


from ..cli import verb, wall_seconds
from ..errors import EXIT_FINDINGS, EXIT_OK, LinepackError
from ..io import OutputSet
from ..progress import stderr_log


@verb("verify", "check an image's code and kernel tables (alone, or --against its original)")
class Verify:
    @staticmethod
    def add_arguments(p):
        p.add_argument("image", help="the ELF image to check (vmlinux or an x86-64 executable)")
        p.add_argument("--against", metavar="OLD",
                       help="also prove IMAGE equivalent to its original OLD (relayout output)")
        p.add_argument("--layout-map", metavar="FILE",
                       help="with --against: also check relayout's layout map (function, old, "
                       "new, size) against the map rebuilt from the symbol tables")
        p.add_argument("--json", metavar="FILE", help="write the machine report to FILE ('-' = stdout)")
        p.add_argument("--strict", action="store_true", help="warnings fail too (exit 1)")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    @staticmethod
    def run(args):
        from ..image.elf import ElfImage
        from ..verify.standalone import cancel_tables, collect_tables, verify_image

        log = stderr_log("verify", args.quiet)
        # Outputs and every input checked before the (long) verification.
        outs = OutputSet(inputs=[args.image, args.against, args.layout_map],
                         outputs={"--json": None if args.json == "-" else args.json})
        layout_map = None
        if args.layout_map:
            if not args.against:
                raise LinepackError("--layout-map needs --against OLD")
            from ..verify.layout_map import read_layout_map
            layout_map = read_layout_map(args.layout_map)     # bad file: fail before the work
        if args.against:
            ElfImage(args.against)                # not an ELF, truncated, ...: fail now
        with outs:
            old_decode = None
            if args.against:
                try:
                    from ..verify.equivalence import start_against, verify_against
                except ImportError:
                    raise LinepackError("verify --against is not available in this build") from None
                old_decode = start_against(args.against)     # OLD decoded beside NEW
            report = None
            try:
                # with --against, NEW's table checks run in a child beside the proof
                report = verify_image(args.image, log=log, fork_tables=bool(args.against))
                if args.against:
                    verify_against(report, args.image, args.against, layout_map=layout_map,
                                   log=log, old_decode=old_decode)
                collect_tables(report)
            finally:
                if old_decode is not None:
                    old_decode.cancel()
                if report is not None:
                    cancel_tables(report)
            report.seconds = wall_seconds()     # the whole command, as the user waited
            if args.json:
                report.write_json(args.json, strict=args.strict)
        if args.json != "-":
            print(report.summary(strict=args.strict))
        return EXIT_OK if report.ok(args.strict) else EXIT_FINDINGS
