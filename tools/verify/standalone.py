"""Standalone verification of one image: well-formedness of code and every
kernel table, plus the static-key census. Produces a ``VerifyReport``.
"""

import time

from .. import timings

from ..image.disasm import KNOWN_UNDECODED
from ..image.elf import ElfImage
from ..kernel import TABLES
from ..errors import LinepackError
from ..kernel.base import Finding, ImageContext
from ..kernel.jump_table import JumpTable
from .report import VerifyReport


def _code_checks(ctx, findings, report=None):
    ft = ctx.functions
    if ctx.is_kernel:
        from ..kernel.prefixes import check_prefixes
        census = check_prefixes(ctx, findings)
        if census is not None and report is not None:
            report.extra["function_prefixes"] = census
    for i, j in ft.overlaps()[:20]:
        findings.append(Finding("error", "functions.overlap", int(ft.start[j]),
                                f"function {ft.name[i]} runs into {ft.name[j]}"))
    bad = ctx.disasm.undecodable
    if bad:
        sample = ", ".join(f"{ctx.symbol_at(a)}" for a, _ in bad[:5])
        findings.append(Finding("warning", "disasm.undecodable", bad[0][0],
                                f"Capstone could not decode {len(bad)} byte(s) in functions "
                                f"(e.g. {sample}); instruction boundaries there are approximate"))


def _coverage(ctx, report, findings):
    """The partition of every executable byte: table in the report, and each
    unexplained run or decoding conflict as a warning with its address."""
    cov = ctx.coverage
    runs = lambda items: [{"address": f"{a:#x}", "section": sec, "bytes": int(n), "reason": why}
                          for a, sec, n, why in items]
    report.coverage = {
        "sections": cov.table(),
        "unexplained": runs(cov.unexplained),
        "data": runs(cov.data_runs),
        "conflicts": [{"address": f"{a:#x}", "section": sec, "reason": why}
                      for a, sec, why in cov.conflicts],
    }
    for a, sec, n, why in cov.unexplained[:20]:
        findings.append(Finding("warning", "coverage.unexplained", a,
                                f"{n} unexplained byte(s) at {ctx.symbol_at(a)} in {sec}: {why}"))
    for a, sec, why in cov.conflicts[:20]:
        findings.append(Finding("warning", "coverage.conflict", a,
                                f"decoding conflict at {ctx.symbol_at(a)} in {sec}: {why}"))


def _eh_frame_checks(image, report, findings):
    """Userspace unwind tables: FDEs parse, .eh_frame_hdr sorted and agreeing."""
    sec = image.section(".eh_frame")
    if sec is None or not sec.size:
        return
    from ..relayout.user.eh_frame import check_eh_frame, parse_eh_frame
    try:
        count = len(parse_eh_frame(image.section_bytes(sec), sec.addr))
        problems = check_eh_frame(image)
    except LinepackError as e:
        findings.append(Finding("warning", "eh_frame.unsupported", sec.addr,
                                f".eh_frame not checked: {e}"))
        return
    for msg in problems:
        findings.append(Finding("error", "eh_frame.hdr", sec.addr, msg))
    report.tables[".eh_frame"] = {"entries": count, "ok": not problems}


def verify_image(path, log=None, tables=None, fork_tables=False):
    """Check one image alone; returns a VerifyReport.

    ``fork_tables``: the table and relocation checks run in a forked child
    (forked.py) while the caller goes on (``verify --against`` on the second
    core); their findings join the report at ``collect_tables(report)``.
    """
    t0 = time.time()
    log = log or (lambda m: None)
    timings.phase("verify: load, decode NEW")
    image = ElfImage(path)
    image.symtab  # raises BadInput for stripped images
    ctx = ImageContext(image, log=log)
    report = VerifyReport(path=path, kernel_version=ctx.banner)
    report.context = ctx          # reused by verify --against (no second decode of NEW)
    findings = report.findings
    log(f"{len(ctx.functions)} functions; decoding instructions")
    _code_checks(ctx, findings, report)
    report.functions = len(ctx.functions)
    report.instructions = len(ctx.disasm)
    report.known_undecoded = {name: 0 for _, _, name in KNOWN_UNDECODED}
    timings.phase("verify: coverage")
    _coverage(ctx, report, findings)
    timings.phase("verify: tables, relocations" + (" (forked)" if fork_tables else ""))
    if fork_tables:
        from .forked import Forked
        report.pending_tables = Forked(_table_checks, ctx, tables, log)
        report.tables_at = len(findings)        # where their findings go
    else:
        _add_table_checks(report, _table_checks(ctx, tables, log))
    report.seconds = time.time() - t0
    return report


def collect_tables(report):
    """Add the forked table checks' findings (verify_image's ``fork_tables``)."""
    pending = getattr(report, "pending_tables", None)
    if pending is not None:
        report.pending_tables = None
        _add_table_checks(report, pending.result(), report.tables_at)


def cancel_tables(report):
    pending = getattr(report, "pending_tables", None)
    if pending is not None:
        pending.cancel()


def _add_table_checks(report, result, at=None):
    found, tables, static_keys, extra = result
    at = len(report.findings) if at is None else at
    report.findings[at:at] = found
    report.tables.update(tables)
    if static_keys is not None:
        report.static_keys = static_keys
    # the report's key order as if they had run first
    report.extra = {**extra, **{k: v for k, v in report.extra.items() if k not in extra}}


def _table_checks(ctx, tables, log):
    """Every kernel table, .eh_frame and the code relocations of one image:
    (findings, {table: {"entries", "ok"}}, static-key census, report extras)."""
    image = ctx.image
    report = VerifyReport(path=image.path, kernel_version=ctx.banner)
    findings = report.findings
    for cls in TABLES:
        if tables and cls.name not in tables:
            continue
        table = cls()
        try:
            loc = table.locate(ctx)
        except ValueError as e:
            findings.append(Finding("error", f"{table.name}.size", None, str(e)))
            report.tables[table.name] = {"entries": 0, "ok": False}
            continue
        if loc is None:
            continue
        entries = table.parse(ctx)
        before = len(findings)
        found = table.check(ctx, entries)
        table.check_relocations(ctx, found, entries)
        findings.extend(found)
        errors = sum(1 for f in found if f.severity == "error")
        report.tables[table.name] = {"entries": int(len(entries)), "ok": errors == 0}
        log(f"{table.name}: {len(entries)} entries, {len(findings) - before} finding(s)")
        if isinstance(table, JumpTable):
            report.static_keys = table.census(ctx, entries)[0]
    _eh_frame_checks(image, report, findings)
    from .relocs import check_code_relocations
    n = check_code_relocations(ctx, findings)
    if n:
        report.extra["relocation_fields_checked"] = n
        log(f"relocations: {n} code fields checked against the relocation sections")
    if ctx.is_kernel and not report.tables:
        findings.append(Finding("warning", "kernel.tables", None,
                                "kernel image without any recognised kernel table"))
    return findings, report.tables, report.static_keys, report.extra
