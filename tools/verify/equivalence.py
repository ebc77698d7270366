"""``verify NEW --against OLD``: prove a rewritten image equivalent to its original.

Independent of the rewriter: the address map is rebuilt here from the two
symbol tables (each function of OLD is found in NEW by its symtab index, so
duplicate static names are no problem), never read from the rewriter's output
unless asked. Then, with Capstone decoding both images:

1. every function of OLD exists in NEW, same size, and every instruction starts
   at the mapped address with the same length;
2. every byte that differs belongs to an address field (branch/call
   displacement, RIP-relative displacement, absolute immediate) whose target,
   translated through the map, is what NEW encodes;
3. every relocated pointer in data sections translates (nothing left pointing
   at old code), and every other data byte is unchanged outside the kernel
   tables;
4. every kernel table's address columns translate as a multiset (sorted tables
   may be re-sorted), kallsyms names keep their translated addresses, and the
   symbol table's code symbols translate.

When NEW carries a ``.linepack.blockmap`` (a block-level layout), the functions
it splits are checked block by block instead (tools/verify/blocks.py), and every
other check translates addresses through the block map where it has pieces.

The checks are registered in CHECKS, in the order their findings go into the
report; each reads one AgainstContext (context.py) and writes into a Sink of
its own (findings.py). One module per subject: code.py (steps 1 and 2),
data.py and reloc_fields.py (step 3), tables.py, symbols.py, unwind.py (step
4), reference_lists.py (the plain PC-relative lists into code), split.py
(block level), pie.py, debuginfo.py, layout_map.py.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .. import timings
from ..image.elf import ElfImage
from ..kernel.base import Finding, ImageContext
from . import code, data, layout_map, reference_lists, reloc_fields, split, symbols, tables, unwind
from .context import AgainstContext
from .debuginfo import _has, check_debuginfo
from .findings import Sink, add_findings
from .forked import Forked
from .pie import check_code_fields, check_pie, old_switch_tables


@dataclass(frozen=True)
class Check:
    """One check of verify --against. ``run(ctx, out)`` adds its findings to
    ``out`` (a Sink). A forked check instead runs ``forked(ctx)`` in a child
    process (forked.py), started before the other checks so that it runs beside
    them, and ``run(ctx, out, result)`` adds the child's answer. ``when(ctx)``:
    whether it applies (default: always); ``phase``: the timings label it starts;
    ``after_forked``: it runs once the forked checks have finished, so that its
    memory peak (the DWARF of both images) does not meet theirs. A forked check
    with ``prepare`` is forked at its turn instead, after ``prepare(ctx)`` ran in
    the parent (what the child needs that the checks before it wait for)."""

    name: str
    run: Callable
    forked: Optional[Callable] = None
    when: Optional[Callable] = None
    phase: Optional[str] = None
    after_forked: bool = False
    prepare: Optional[Callable] = None

    def applies(self, ctx):
        return self.when is None or bool(self.when(ctx))


def _check_build_id(ctx, out):
    """relayout keeps the .notes section, so a rewrite keeps its original's build-id."""
    old, new = ctx.old, ctx.new
    if old.build_id and new.build_id and old.build_id != new.build_id:
        out.findings.append(Finding("error", "equiv.build-id", None,
                                    f"the images come from different builds (build-id "
                                    f"{new.build_id[:16]}... vs original {old.build_id[:16]}...): "
                                    "NEW is not a rewrite of OLD"))


def _check_functions(ctx, out):
    """Every function of OLD exists in NEW, with the same size unless it was split."""
    of, nf, oi, ni = ctx.of, ctx.nf, ctx.oi, ctx.ni
    out.add("equiv.function-missing", ctx.missing,
            lambda i: (int(of.start[i]), f"function {of.name[i]} of the original is missing"))
    out.add("equiv.function-size", ctx.size_diff.tolist(),
            lambda k: (int(nf.start[ni[k]]), f"{of.name[oi[k]]} changed size "
                       f"{int(of.size[oi[k]])} -> {int(nf.size[ni[k]])}"))


def _check_member_function_parity(ctx, out):
    """C++: a mangled function at an even address stays at one. A pointer to
    member function marks a virtual one by its low bit (Itanium ABI), so gcc
    aligns member functions to 2 bytes; gcc's own ``.cold`` parts are no target."""
    of, nf, oi, ni = ctx.of, ctx.nf, ctx.oi, ctx.ni
    names = [of.name[i] for i in oi.tolist()]
    cxx = np.array([n.startswith("_Z") and ".cold" not in n for n in names], bool)
    odd = ((of.start[oi] & 1) == 0) & ((nf.start[ni] & 1) == 1)
    out.add("equiv.member-function-parity", np.nonzero(cxx & odd)[0].tolist(),
            lambda k: (int(nf.start[ni[k]]), f"{names[k]} was at an even address and is "
                       "at an odd one: a pointer to member function naming it reads as virtual"))


def _check_ibt_entries(ctx, out):
    """IBT (kernels, and executables built with ``-fcf-protection``, whose
    ``.note.gnu.property`` can mark them IBT): every function that began with ENDBR64
    still does (kernel/prefixes.py): an indirect call or a function pointer lands there."""
    from ..kernel.prefixes import check_endbr_entries
    n = check_endbr_entries(ctx.octx, ctx.nctx, ctx.oi, ctx.ni, out.findings, out.counter,
                            add_findings)
    if n:
        out.extra["ibt_entries_checked"] = n


_ENDBR64 = b"\xf3\x0f\x1e\xfa"
# a call right before an ENDBR64: rel32 (e8, 5 bytes) or through a RIP-relative slot
# (ff 15, 6 bytes: -fno-plt)
_CALL_FORMS = ((b"\xe8", 5), (b"\xff\x15", 6))


def _check_ibt_landings(ctx, out):
    """Executables built with ``-fcf-protection``: gcc puts an ENDBR64 right after
    every call to a function that returns twice (``setjmp``, ``vfork``...), because
    the second return comes by an indirect jump (``longjmp``) to the call's return
    address. Each such call stays followed by its ENDBR64: an inserted jmp between
    them would be where ``longjmp`` lands, which faults under IBT."""
    oimg, nimg = ctx.octx.image, ctx.nctx.image
    calls, lands = [], []
    for sec in oimg.sections:
        if not (sec.is_alloc and sec.is_code and sec.size):
            continue
        data = bytes(oimg.section_bytes(sec))
        at = data.find(_ENDBR64)
        while at >= 0:
            for op, size in _CALL_FORMS:
                if at >= size and data[at - size:at - size + len(op)] == op:
                    calls.append(sec.addr + at - size)
                    lands.append(sec.addr + at)
                    break
            at = data.find(_ENDBR64, at + 1)
    calls = np.asarray(calls, np.uint64)
    lands = np.asarray(lands, np.uint64)
    # a function's entry right after the call that ends the one before (a noreturn
    # call, no padding between them) is no landing: the entries are checked above
    keep = ~np.isin(lands, np.asarray(ctx.of.start, np.uint64))
    calls, lands = calls[keep], lands[keep]
    if not len(lands):
        return
    from ..kernel.prefixes import endbr_at
    n_call, n_land = ctx.amap.map(calls), ctx.amap.map(lands)
    size = lands - calls
    ok = (n_land == n_call + size) & endbr_at(nimg, n_land)
    bad = np.nonzero(~ok)[0].tolist()
    out.add("equiv.ibt-landing", bad,
            lambda k: (int(n_land[k]), f"the ENDBR64 after the call at {int(calls[k]):#x} "
                       f"(now {int(n_call[k]):#x}) is no longer right after it: a second "
                       "return (longjmp) would land elsewhere, which faults under IBT"))
    out.extra["ibt_landings_checked"] = len(lands)


def _check_prefix_room(ctx, out):
    """Prefixed kernels: call-depth tracking still finds its thunk's room of NOPs
    before every function that had a prefix (kernel/prefixes.py)."""
    from ..kernel.prefixes import check_prefix_room
    n = check_prefix_room(ctx.octx, ctx.nctx, ctx.oi, ctx.ni, out.findings, out.counter,
                          add_findings)
    if n:
        out.extra["prefix_room_checked"] = n


def _check_code_fields(ctx, out):
    """Switch tables and PC-relative data fields into code, in any executable (pie.py)."""
    check_code_fields(ctx.old, ctx.new, ctx.amap, ctx.octx, out.findings, out.counter, out,
                      add_findings)


def _check_pie(ctx, out):
    """A PIE's dynamic relocations, PIC switch tables and .dynamic (pie.py)."""
    check_pie(ctx.old, ctx.new, ctx.amap, ctx.octx, out.findings, out.counter, out, add_findings)


def _debuginfo_results(ctx):
    """The DWARF check (debuginfo.py) on its own: a Sink with its findings,
    counts and extras. Forked: it reads both images' DWARF a slice at a time
    (about 150 MB), beside the instruction checks on the other core."""
    out = Sink()
    check_debuginfo(ctx.old, ctx.new, ctx.amap, out.findings, out.counter, out, ctx.log)
    return out


def _add_debuginfo(ctx, out, result):
    out.findings.extend(result.findings)
    out.counter.update(result.counter)
    out.extra.update(result.extra)


# The checks, in the order of the report.
CHECKS = [
    Check("build-id", _check_build_id),
    Check("functions", _check_functions),
    Check("member-function-parity", _check_member_function_parity),
    Check("ibt-entries", _check_ibt_entries),
    Check("ibt-landings", _check_ibt_landings, when=lambda ctx: not ctx.octx.is_kernel),
    Check("prefix-room", _check_prefix_room, when=lambda ctx: ctx.octx.is_kernel),
    Check("data-symbols", data.check_data_symbols),
    # an executable's instructions are compared in a child, beside the checks after
    # it (a kernel's in this process: a child of a 1 GB verify would add its peak)
    Check("code", code.check_code, when=lambda ctx: ctx.kernel),
    Check("code-forked", code.add_code_results, forked=code.code_results,
          prepare=code.prepare_code, phase="against: instructions",
          when=lambda ctx: not ctx.kernel),
    Check("blocks", split.add_block_findings, forked=split.block_results,
          when=lambda ctx: ctx.split.any()),
    Check("moved-data-fields", data.check_moved_data_fields),
    Check("data-pointers", data.check_data_pointers, phase="against: data, regions, relocations"),
    Check("regions", data.check_regions),
    Check("relocations", reloc_fields.check_relocations),
    Check("kernel-tables", tables.check_tables, phase="against: tables, symbols"),
    Check("reference-lists", reference_lists.check_reference_lists,
          when=lambda ctx: ctx.octx.is_kernel),
    Check("eh-frame", unwind.check_eh_frame),
    Check("symbols", symbols.check_symbols),
    Check("code-fields", _check_code_fields),
    Check("pie", _check_pie),
    # (no fork for an original without DWARF: the check would find nothing)
    Check("debuginfo", _add_debuginfo, forked=_debuginfo_results,
          when=lambda ctx: _has(ctx.old, ".debug_info")),
    Check("layout-map", layout_map.check_layout_map, phase="against: rest",
          when=lambda ctx: ctx.layout_map),
]


def _decoded_old(path):
    """What decoding OLD produces (its coverage, detached from the image, and its
    instructions) and, in an executable, its switch tables (pie.switch_tables: they
    depend on OLD alone), computed in start_against's child (``relayout --verify``:
    beside the rewrite)."""
    ctx = ImageContext(ElfImage(path))
    dis = ctx.disasm
    cov = ctx.coverage
    tables = None if ctx.is_kernel else old_switch_tables(ctx)
    if not ctx.is_kernel:
        code.all_branch_targets(dis)    # code.py's, kept on dis (an executable's are small)
    cov.image = None
    return cov, dis, tables


def start_against(old_path):
    """Start decoding OLD in a forked child (forked.py) so that it runs while
    NEW is decoded and checked alone; pass the result to verify_against as
    ``old_decode`` (or ``cancel()`` it)."""
    return Forked(_decoded_old, old_path)


def verify_against(report, new_path, old_path, layout_map=None, log=None, old_decode=None):
    """Add equivalence findings to ``report`` (a VerifyReport of NEW).

    The map is never taken from the rewriter's output: it is rebuilt from the
    two symbol tables, so this check stays independent of relayout. A layout
    map written by relayout (``layout_map``: rows from read_layout_map) is
    checked against it. Runs every check of CHECKS that applies.
    """
    ctx = AgainstContext(report, new_path, old_path, layout_map=layout_map, log=log,
                         old_decode=old_decode)
    checks = CHECKS
    sinks = {c.name: Sink() for c in checks}
    # forked checks first, so that they run beside the others; they decode what
    # they need themselves and need nothing the others make
    children = {c.name: Forked(c.forked, ctx) for c in checks
                if c.forked and not c.prepare and c.applies(ctx)}
    try:
        for c in checks:
            if c.forked:
                if c.prepare and c.applies(ctx):
                    c.prepare(ctx)
                    if c.phase:
                        timings.phase(c.phase)
                    children[c.name] = Forked(c.forked, ctx)
                continue
            if c.after_forked:
                _collect(checks, children, ctx, sinks)
            if c.phase:
                timings.phase(c.phase)
            if c.applies(ctx):
                c.run(ctx, sinks[c.name])
        _collect(checks, children, ctx, sinks)
    finally:
        for child in children.values():
            child.cancel()
    counter = {}
    for c in checks:
        sinks[c.name].add_to(report, counter)
    report.extra["equivalence_moved_functions"] = ctx.moved
    report.extra["against"] = old_path
    # the full count per check (the findings list stops at MAX_REPORT per check)
    report.extra["equivalence_counts"] = {k: int(v) for k, v in counter.items()}
    ctx.log("equivalence: " + (", ".join(f"{k} {v}" for k, v in counter.items()) or "no problems"))
    return report


def _collect(checks, children, ctx, sinks):
    """Wait for the forked checks still running and add their answers."""
    if not children:
        return
    timings.phase("against: blocks (wait)")
    for c in checks:
        if c.name in children:
            c.run(ctx, sinks[c.name], children.pop(c.name).result())
