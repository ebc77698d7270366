"""``linepack references VMLINUX --vmlinuz VMLINUZ``: the references relayout
would use for a kernel without link relocations, recovered from its boot image,
the code and the kernel tables; on a vmlinux that kept its link relocations
(Debian 6.1) also compared with them: recovered / missing / extra by section.

Exit 0 = nothing missing, 1 = a link relocation into or out of movable code
that the recovery does not list, 2 = bad input.
"""

import json

from ..cli import verb
from ..errors import EXIT_FINDINGS, EXIT_OK
from ..io import OutputSet, write_atomic


@verb("references", "recover a kernel's references from its vmlinuz (no link relocations "
      "needed); against the link relocations where the vmlinux kept them")
class ReferencesVerb:
    @staticmethod
    def add_arguments(p):
        p.add_argument("image", help="the vmlinux (with symbols: the -dbg package's)")
        p.add_argument("--vmlinuz", metavar="VMLINUZ", required=True,
                       help="the boot image of the same build (its KASLR relocation table)")
        p.add_argument("--json", metavar="FILE", help="write the report as JSON ('-' = stdout)")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    @staticmethod
    def run(args):
        from ..image import references as R
        from ..image.elf import ElfImage
        from ..progress import stderr_log
        from ..relayout.kernel.recovered import load_for_layout, movable_ranges
        from ..relayout.units import units_of
        log = stderr_log("references", args.quiet, clock=True)

        outs = OutputSet(inputs=[args.image, args.vmlinuz],
                         outputs={"--json": None if args.json == "-" else args.json})
        with outs:
            image = ElfImage(args.image)
            units, functions, dis = units_of(image, log)
            lo, hi, _ = movable_ranges(units)
            lo, hi = lo.copy(), hi.copy()          # before unexplained values pin more
            # the same decode relayout --vmlinuz recovers from
            refs = load_for_layout(image, args.vmlinuz, units, log=log, dis=dis)
            report = {"image": args.image, "vmlinuz": args.vmlinuz,
                      "recovered": R.summary_of(refs)["references"]}
            compared = None
            if image.has_link_relocations():
                from ..image.context import ImageContext
                link = R.link_references(image, ImageContext.of(image).disasm)
                compared = R.compare(image, refs, link, lo, hi)
                report["against_link_relocations"] = compared
            if args.json == "-":
                print(json.dumps(report, indent=1, sort_keys=True))
            elif args.json:
                write_atomic(args.json, json.dumps(report, indent=1, sort_keys=True) + "\n")
        st = refs.stats
        if args.json != "-":
            print(f"references of {args.image} recovered from {args.vmlinuz}: {len(refs)} fields")
            print(f"  absolute (KASLR table): {st['references.kaslr-64']} 64-bit, "
                  f"{st['references.kaslr-32']} 32-bit")
            print(f"  kernel tables:          {st['references.table']} PC-relative fields")
            print(f"  code:                   {st['references.code-branch']} rel32 branches, "
                  f"{st['references.code-rip']} RIP-relative operands "
                  f"({st['references.percpu_pc32'] - st['references.percpu_pc32_not_in_code']} "
                  f"of {st['references.percpu_pc32']} per-CPU fields of the table among them)")
            un = refs.unexplained or {}
            print(f"  unexplained:            {un.get('fields', 0)} data values into movable "
                  f"code, {un.get('functions_pinned', 0)} units pinned")
            if compared is not None:
                c = compared
                print(f"against the link relocations: {c['relevant']} into or out of movable "
                      f"code, {c['recovered']} recovered, {c['missing']} missing, "
                      f"{c['wrong_target']} with another target; {c['extra']} recovered "
                      "fields without a link relocation")
                width = max([len(n) for n in c["by_section"]] + [8])
                for name, d in sorted(c["by_section"].items()):
                    print(f"  {name:<{width}} relevant {d['relevant']:>7}  missing "
                          f"{d['missing']:>5}  other target {d['wrong_target']:>4}  extra "
                          f"{d['extra']:>6}")
        if compared is not None and (compared["missing"] or compared["wrong_target"]):
            return EXIT_FINDINGS
        return EXIT_OK
