"""``linepack profile``: record or import a profile, export it for BOLT, or show it.

    linepack profile --kernel VMLINUX --workload vfs-mix [--loops N] -o PROFILE   (QEMU)
    linepack profile --program PATH [-o PROFILE] [-- ARGS...]    (qemu-x86_64, PIE or not)
    linepack profile --perf-script FILE --image IMAGE -o PROFILE [--kaslr-offset X|auto]
    linepack profile --fdata FILE --image IMAGE -o PROFILE
    linepack profile --export-fdata PROFILE [--image IMAGE] -o out.fdata
    linepack profile --show PROFILE [--top N]
    linepack profile --merge P1 P2 ... [--weights W1,W2,...] [--image IMAGE] -o PROFILE

Progress goes to stderr; one summary line (or the --show report) to stdout.
"""

import importlib
import os

from ..cli import verb, wall_seconds
from ..errors import BadInput
from ..io import OutputSet
from ..progress import stderr_log


_log = stderr_log("linepack profile")


@verb("profile", "record a profile (QEMU), import perf script / BOLT fdata, export fdata, or show one")
class ProfileVerb:
    @staticmethod
    def add_arguments(p):
        src = p.add_mutually_exclusive_group()
        src.add_argument("--kernel", metavar="VMLINUX", help="profile this kernel under QEMU (TCG plugin)")
        src.add_argument("--program", metavar="PATH",
                         help="profile this userspace program (PIE or not) under qemu-x86_64 with the "
                              "plugin; its arguments follow '--'")
        src.add_argument("--perf-script", metavar="FILE",
                         help="import `perf script -F ip,brstack` (LBR) or `-F ip[,sym]` (IP samples) text")
        src.add_argument("--fdata", metavar="FILE", help="import a BOLT .fdata profile")
        src.add_argument("--export-fdata", metavar="PROFILE", help="write PROFILE as BOLT .fdata to -o")
        src.add_argument("--show", metavar="PROFILE", help="print a summary of PROFILE")
        src.add_argument("--merge", nargs="+", metavar="PROFILE",
                         help="merge profiles of several workloads into -o, each normalised to "
                              "the same total (linepack profiles; .fdata or perf script text "
                              "with --image)")
        p.add_argument("--image", metavar="IMAGE", help="the ELF image the profile belongs to")
        p.add_argument("-o", "--output", metavar="PATH", help="output profile (or .fdata with --export-fdata)")
        p.add_argument("--kaslr-offset", metavar="X|auto",
                       help="subtract this runtime shift from recorded addresses (hex), or 'auto' to detect it")
        p.add_argument("--workload", help="workload name (QEMU: the one to run; imports: recorded as metadata)")
        p.add_argument("--loops", type=int, help="workload iterations (metadata; QEMU: how many to run)")
        p.add_argument("--cmdline", help="kernel command line the profile was recorded with (metadata)")
        p.add_argument("--weights", metavar="W1,W2,...",
                       help="with --merge: relative weight of each input (default: equal)")
        p.add_argument("--top", type=int, default=15, help="functions listed by --show (default 15)")
        p.add_argument("--exit-status", metavar="N[,N...]|any",
                       help="with --program: the exit statuses of a run to keep (default 0: "
                            "grep finding nothing exits 1); a program killed by a signal is "
                            "never kept")
        p.add_argument("program_args", nargs="*", metavar="ARGS",
                       help="with --program: the program's arguments (after '--')")

    @staticmethod
    def run(args):
        if args.weights and not args.merge:
            raise BadInput("--weights applies to --merge")
        if args.exit_status is not None and not args.program:
            raise BadInput("--exit-status applies to --program")
        if args.show:
            return _show(args)
        # -o checked before any work, and written only when the whole run succeeds.
        with OutputSet(inputs=[args.kernel, args.program, args.perf_script, args.fdata,
                               args.export_fdata, args.image] + list(args.merge or []),
                       outputs={"-o": args.output}):
            return _dispatch(args)


def _dispatch(args):
    if args.merge:
        return _merge(args)
    if args.export_fdata:
        return _export(args)
    if args.kernel:
        return _record_qemu(args)
    if getattr(args, "program", None):
        return _record_program(args)
    if getattr(args, "program_args", None):
        raise BadInput(f"unexpected arguments {' '.join(args.program_args)!r} "
                       "(program arguments go after --program PATH --)")
    if args.perf_script or args.fdata:
        return _import(args)
    raise BadInput("nothing to do: give --kernel, --perf-script, --fdata, --export-fdata or --show "
                   "(see 'linepack profile --help')")


def _meta(args):
    m = {}
    if args.workload:
        m["workload"] = args.workload
    if args.loops is not None:
        m["loops"] = args.loops
    if args.cmdline:
        m["cmdline"] = args.cmdline
    return m


def _need(args, *names):
    for n in names:
        if not getattr(args, n):
            raise BadInput(f"--{n.replace('_', '-')} is required here (see 'linepack profile --help')")


def _import(args):
    from ..image.elf import ElfImage
    from ..profile.symbolize import parse_offset
    _need(args, "image", "output")
    image = ElfImage(args.image)
    if args.perf_script:
        from ..profile.perf_script import import_perf_script
        prof = import_perf_script(args.perf_script, image, parse_offset(args.kaslr_offset), _meta(args),
                                  log=_log)
    else:
        if args.kaslr_offset:
            raise BadInput("--kaslr-offset applies to --perf-script (fdata holds symbol offsets)")
        from ..profile.fdata import import_fdata
        prof = import_fdata(args.fdata, image, _meta(args), log=_log)
    prof.save(args.output)
    hot = prof.hot_functions(1)
    top = f", hottest {hot[0][0]}" if hot else ""
    print(f"{args.output}: {prof.source} profile of {os.path.basename(image.path)}: "
          f"{len(prof.func_addr)} functions, {prof.meta.get('samples', 0)} samples, "
          f"{len(prof.edge_from)} edges{top} ({wall_seconds():.1f} s)")
    return 0


def _export(args):
    from ..profile.fdata import export_fdata
    from ..profile.model import Profile
    _need(args, "output")
    prof = Profile.load(args.export_fdata)
    n = export_fdata(prof, args.output, image=args.image, log=_log)
    kind = "branch records" if len(prof.edge_from) else "no_lbr samples"
    print(f"{args.output}: {n} {kind} from {args.export_fdata}")
    return 0


def _show(args):
    from ..image.elf import ElfImage
    from ..profile.model import Profile
    prof = Profile.load(args.show)
    if args.image:
        prof.check_image(ElfImage(args.image))
    print("\n".join(prof.summary(top=args.top)))
    if prof.metric == "insns" and prof.meta.get("mode") != "user":
        # the shares of kernel code QEMU's emulation inflates: none in a program
        from ..profile.emulation import emulation_shares
        print("\n".join(emulation_shares(prof).lines()))
    return 0


def _merge(args):
    from ..image.elf import ElfImage
    from ..profile.merge import load_any, merge_profiles
    _need(args, "output")
    weights = None
    if args.weights:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise BadInput(f"--weights {args.weights!r}: expected comma-separated numbers") from None
    image = ElfImage(args.image) if args.image else None
    profs = [load_any(p, image, log=_log) for p in args.merge]
    if image is not None:
        for p in profs:
            p.check_image(image)
    merged = merge_profiles(profs, weights)
    merged.save(args.output)
    parts = ", ".join(f"{m['workload']} x{m['weight']:g}" for m in merged.meta["merged"])
    print(f"{args.output}: merged {len(profs)} {merged.metric} profiles ({parts}): "
          f"{len(merged.func_addr)} functions, {len(merged.edge_from)} edges")
    return 0


def _exit_statuses(text):
    """--exit-status: None for "any", else the set of statuses (default {0})."""
    if text is None:
        return {0}
    if text.strip().lower() == "any":
        return None
    try:
        ok = {int(w) for w in text.split(",")}
    except ValueError:
        ok = set()
    if not ok or any(not 0 <= n <= 255 for n in ok):
        raise BadInput(f"--exit-status {text!r}: exit statuses 0-255, comma-separated, or 'any'")
    return ok


def _record_program(args):
    from ..profile.user import record_user
    _need(args, "output")
    ok = _exit_statuses(args.exit_status)
    prof = record_user(args.program, args.program_args or [], output=args.output,
                       meta=_meta(args), log=_log, exit_ok=ok)
    hot = prof.hot_functions(1)
    status = prof.meta.get("exit_status", 0)
    threads = prof.meta.get("threads", 1)
    print(f"{args.output}: qemu-user profile of {os.path.basename(args.program)}: "
          f"{len(prof.func_addr)} functions, {prof.meta.get('instructions', 0):,} instructions, "
          f"{len(prof.edge_from)} edges{', hottest ' + hot[0][0] if hot else ''}"
          f"{f', {threads} threads summed' if threads > 1 else ''}"
          f"{f', exit status {status}' if status else ''} ({wall_seconds():.1f} s)")
    return 0


def _record_qemu(args):
    _need(args, "output")
    try:
        record = importlib.import_module("linepack.profile.record")
    except ModuleNotFoundError as e:
        if e.name in ("linepack.profile.record",):
            raise BadInput("QEMU profiling is not built yet (linepack.profile.record is missing); "
                           "import a perf or fdata profile instead") from None
        raise
    fn = getattr(record, "record_qemu", None)
    if fn is None:
        raise BadInput("QEMU profiling is not built yet (no record_qemu in linepack.profile.record)")
    prof = fn(kernel=args.kernel, workload=args.workload or "vfs-mix", loops=args.loops,
              output=args.output, meta=_meta(args), log=_log)
    # Contract: record_qemu(kernel=, workload=, loops=, output=, meta=, log=) returns a
    # Profile (Profile.from_blocks); saving it here is idempotent if it saved itself.
    if prof is not None:
        prof.save(args.output)
        hot = prof.hot_functions(1)
        print(f"{args.output}: qemu profile of {os.path.basename(args.kernel)}: {len(prof.func_addr)} "
              f"functions{', hottest ' + hot[0][0] if hot else ''}")
    return 0
