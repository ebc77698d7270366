"""What differs between relaying out a kernel and a userspace executable.

relayout's passes (relayout/passes.py) ask the image's target, never the image's
kind: which code addresses the CFG must keep as block leaders (table sites),
which functions' unwind information forbids a split, which tables or metadata
follow the layout, and what a block-level layout adds to the symbols.

- ``KernelTarget`` (vmlinux: a ``linux_banner`` and ``_stext``): the kernel's
  tables (relayout/kernel/), ORC through them, kallsyms grown for ``.cold`` parts.
- ``UserTarget`` (executables, PIE or not): PIC switch tables, ``.eh_frame`` /
  ``.eh_frame_hdr`` / LSDAs, ``.dynsym``, a PIE's dynamic section
  (relayout/user/).
"""

import numpy as np

from ..image.context import ImageContext


class Target:
    """The interface; see the two implementations."""
    kind = ""
    pic = None                 # PIC switch-table entries the relocation pass follows

    def __init__(self, image):
        self.image = image
        self.ctx = ImageContext.of(image)       # the image's one context, shared

    def prepare(self, run):
        """After disassembly: target data the later passes need; returns counters
        for DisassemblyStats (keyword arguments)."""
        return {}

    def table_sites(self, run):
        """(TableSites for the CFG, indirect jumps allowed?)."""
        raise NotImplementedError

    def short_static_keys(self):
        """May the split emit 2-byte static-key sites? Not for a kernel before 5.14
        (its banner tells)."""
        from ..kernel.jump_table import SHORT_SITES_SINCE
        return self.ctx.version is None or self.ctx.version[:2] >= SHORT_SITES_SINCE

    def unwind_split(self, run, cfg, heat, strategy):
        """Mark the functions whose unwind information cannot be split; returns an
        object with ``accept``/``rebuild`` (or None) for the split and metadata passes."""
        return None

    def update_metadata(self, run, block_level):
        """Tables and metadata that follow the layout, in the rewriter's patched
        sections; returns the kernel table names written (for the summary)."""
        raise NotImplementedError

    def block_symbols(self, run):
        """Block level, after the ``.cold`` symbols: what the target adds; returns
        (allocated sections to add, program header updates) for write_image."""
        return [], None

    def new_segment(self, run):
        """Room for a layout that does not fit in place: a NewSegment
        (relayout/user/segment.py) or None (a kernel: its layout fits or fails)."""
        return None


class KernelTarget(Target):
    kind = "kernel"

    def table_sites(self, run):
        from ..image.cfg import TableSites
        return TableSites.from_kernel(self.ctx), False

    def update_metadata(self, run, block_level):
        from .kernel.kernel_tables import update_kernel_tables
        # a block-level layout rebuilds kallsyms with its .cold parts (block_symbols)
        done = update_kernel_tables(run.rewriter, run.log,
                                    skip=("kallsyms",) if block_level else ())
        return list(done)

    def block_symbols(self, run):
        from .kernel.kallsyms_cold import NoRoom, add_cold_kallsyms
        from .kernel.kernel_tables import update_kernel_tables
        rw = run.rewriter
        try:
            grown = add_cold_kallsyms(rw, self.image, run.log)
        except NoRoom as e:
            if self.ctx.recovered is not None:
                # references recovered from a vmlinuz: a kernel whose .cold parts have
                # no kallsyms entries fails verify (equiv.kallsyms-cold): write nothing
                from .rewriter import RewriteError
                raise RewriteError(f"{self.image.path}: no kallsyms entries for the .cold "
                                   f"parts: {e}; nothing written (a function-level strategy "
                                   "such as pack works from a vmlinuz)") from None
            grown = None
            rw.problems.append(("kallsyms-cold", 0, f"no kallsyms entries for the .cold parts: {e}"))
            run.log(f"warning: no kallsyms entries for the .cold parts: {e}")
            update_kernel_tables(rw, run.log, only=("kallsyms",))
        if grown and grown[0]:
            return [grown[0]], grown[1]
        return [], None


class UserTarget(Target):
    kind = "userspace"

    def __init__(self, image):
        super().__init__(image)
        from .user.pie import is_pie
        self.pie = is_pie(image)

    def prepare(self, run):
        """PC-relative data fields into code, PIE or not (gcc's default -fPIE code
        linked -no-pie has PIC switch tables too): switch-table entries are
        translated as entries; a loose field is left as it is and the units it may
        designate are pinned (before the heat, which is per unit)."""
        from .units import pin_units
        from .user.pie import pic_table_entries
        self.pic = pic = pic_table_entries(self.image, run.dis, run.functions)
        pinned = run.units.find(pic.loose_targets)
        pinned = np.unique(pinned[pinned >= 0])
        pic.pinned_units = len(pinned)
        if len(pinned):
            run.units = run.orig_units = pin_units(run.units, pinned)
        run.log(f"{len(pic)} PIC switch-table entries, {pic.self_relative} self-relative "
                "data fields into code" + (
                    f"; {pic.unexplained} PC-relative data fields into code not explained: "
                    f"left as they are, {len(pinned)} functions they may designate pinned"
                    if pic.unexplained else ""))
        return {"pic_table_entries": len(pic), "pcrel_data_unexplained": pic.unexplained,
                "pcrel_self_relative": pic.self_relative, "pcrel_pinned_units": len(pinned),
                "pcrel_examples": pic.examples(self.image, run.functions)
                if pic.unexplained else []}

    def table_sites(self, run):
        from .user.user_blocks import user_table_sites
        sites, indirect_ok, note = user_table_sites(self.image, self.pic)
        run.log(note)
        return sites, indirect_ok

    def unwind_split(self, run, cfg, heat, strategy):
        """Mark the functions whose unwind information cannot be split
        (relayout/user/eh_frame_split.py); returns the EhSplit, or None when the
        image's unwind sections cannot be rebuilt (then no function with an FDE is
        split)."""
        import struct
        from ..image.cfg import R_EH_FRAME
        from .user.eh_frame import EhFrameError, parse_eh_frame
        from .user.eh_frame_split import EhSplit
        image, units = self.image, run.units
        eh = image.section(".eh_frame")
        if eh is None or not eh.size:
            return None
        try:
            eh_split = EhSplit(image)
        except (EhFrameError, ValueError, IndexError, KeyError, struct.error) as e:
            run.log(f"not splitting functions with unwind information: {e}")
            fde = parse_eh_frame(image.section_bytes(eh), eh.addr)
            covered = units.find(fde.pc_begin[fde.pc_range > 0])
            cfg._mark(np.unique(covered[covered >= 0]), R_EH_FRAME)
            return None
        cand = np.nonzero((np.asarray(cfg.reason) == 0) & (heat >= strategy.min_count))[0]
        for u in cand.tolist():
            if len(units.members[u]) != 1:
                continue              # several functions in one unit: choose_splits names that
            r = eh_split.reason(int(units.start[u]), int(units.end[u]))
            if r:
                cfg._mark(np.array([u]), r)
        return eh_split

    def update_metadata(self, run, block_level):
        from .user.dynsym import update_dynsym
        rw, log = run.rewriter, run.log
        split = run.split
        if split is not None and split["eh_split"] is not None:
            st = split["eh_split"].rebuild(rw, split["splits"], run.orig_units.start)
            rw.stats.update(st)
            log(f"rebuilt .eh_frame: {st['eh_frame.cold_fdes']} cold-part FDEs added, "
                f".eh_frame_hdr table re-sorted ({st['eh_frame_hdr.entries']} entries)")
        else:
            from .user.eh_frame import update_eh_frame
            update_eh_frame(rw, log)
        update_dynsym(rw, self.image, log)
        from .user.pie import update_dynamic
        update_dynamic(rw, self.image, log)
        return []

    def new_segment(self, run):
        """The moved code goes to a new PT_LOAD segment (the executable as linked
        has no room after .text)."""
        from .user.segment import NewSegment
        if self.image.section(".text") is None:
            return None
        return NewSegment(self.image)

    def block_symbols(self, run):
        from .user.eh_frame_split import fix_section_symbols
        fix_section_symbols(run.rewriter, self.image)
        return [], None


def target_for(image):
    """KernelTarget for a vmlinux, UserTarget for an executable."""
    return KernelTarget(image) if ImageContext.of(image).is_kernel else UserTarget(image)
