"""``linepack verify IMAGE [--against OLD]``: Capstone verification for CI.

``verify NEW_VMLINUZ --vmlinux NEW_VMLINUX [--against OLD]``: the boot image's
payload checked against the vmlinux it was made from (verify/bootimage.py), then
that vmlinux verified as usual.

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
        p.add_argument("image", help="the ELF image to check (vmlinux or an x86-64 executable), "
                       "or a boot image (vmlinuz) with --vmlinux")
        p.add_argument("--vmlinux", metavar="VMLINUX",
                       help="IMAGE is a boot image (bzimage's output): check that its payload is "
                       "VMLINUX (segments, entry, KASLR relocation table), then verify VMLINUX")
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
        return check(args.image, args.against, layout_map=args.layout_map, json_path=args.json,
                     strict=args.strict, quiet=args.quiet, vmlinux=args.vmlinux)


def check(image, against=None, layout_map=None, json_path=None, strict=False, quiet=False,
          old_decode=None, vmlinux=None):
    """The whole of ``verify IMAGE [--against OLD]``: the checks, the report (``json_path``,
    '-' = stdout), the summary printed; returns the exit status. ``relayout --verify``
    calls it on its output in the same process (``old_decode``: OLD's decode already
    started, start_against). ``vmlinux``: ``image`` is a boot image whose payload
    must be that vmlinux, which is then the image verified."""
    from ..image.elf import ElfImage
    from ..verify.standalone import cancel_tables, collect_tables, verify_image

    log = stderr_log("verify", quiet)
    try:
        # Outputs and every input checked before the (long) verification.
        outs = OutputSet(inputs=[image, against, layout_map, vmlinux],
                         outputs={"--json": None if json_path == "-" else json_path})
        boot = None
        from ..verify.bootimage import check_boot_image, is_boot_image
        if vmlinux is not None:
            if not is_boot_image(image):
                raise LinepackError(f"{image}: not a boot image (bzImage/vmlinuz): --vmlinux "
                                    "checks a boot image's payload")
            boot = check_boot_image(image, vmlinux, log=log)      # bad inputs fail now
            image = vmlinux
        elif is_boot_image(image):
            raise LinepackError(f"{image}: a boot image (bzImage/vmlinuz): give the vmlinux its "
                                "payload was made from with --vmlinux VMLINUX")
        layout_rows = None
        if layout_map:
            if not against:
                raise LinepackError("--layout-map needs --against OLD")
            from ..verify.layout_map import read_layout_map
            layout_rows = read_layout_map(layout_map)     # bad file: fail before the work
        if against:
            ElfImage(against)                     # not an ELF, truncated, ...: fail now
    except BaseException:
        if old_decode is not None:
            old_decode.cancel()
        raise
    with outs:
        if against and old_decode is None:
            try:
                from ..verify.equivalence import start_against
            except ImportError:
                raise LinepackError("verify --against is not available in this build") from None
            old_decode = start_against(against)     # OLD decoded beside NEW
        report = None
        try:
            # with --against, NEW's table checks run in a child beside the proof
            report = verify_image(image, log=log, fork_tables=bool(against))
            if against:
                from ..verify.equivalence import verify_against
                verify_against(report, image, against, layout_map=layout_rows,
                               log=log, old_decode=old_decode)
            collect_tables(report)
            if boot is not None:
                boot.add_to(report, report.extra.setdefault("boot_image_counts", {}))
        finally:
            if old_decode is not None:
                old_decode.cancel()
            if report is not None:
                cancel_tables(report)
        report.seconds = wall_seconds()     # the whole command, as the user waited
        if json_path:
            report.write_json(json_path, strict=strict)
    if json_path != "-":
        print(report.summary(strict=strict))
    return EXIT_OK if report.ok(strict) else EXIT_FINDINGS
