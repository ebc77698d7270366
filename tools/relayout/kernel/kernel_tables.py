"""Kernel tables after a relayout, through each table's update/write.

The generic relocation pass already translated every relocated field; the
tables here need more: re-sorting (ORC, __ex_table, __mcount_loc), or they
carry no usable relocations (6.1's __ex_table relocations are R_X86_64_NONE),
or none at all (kallsyms).
"""

import numpy as np

from ...image.context import ImageContext

# Tables with an update/write pair, in the order they are applied.
RELAYOUT_TABLES = ("__ex_table", "orc_unwind", "__mcount_loc", "kallsyms")


class PatchedImage:
    """Write access to the rewriter's new section contents by virtual address."""

    def __init__(self, rw):
        self.rw = rw

    def write(self, addr, data):
        data = np.asarray(data, dtype=np.uint8)
        sec = self.rw.image.section_at(addr)
        if sec is None or addr + len(data) > sec.end:
            raise ValueError(f"write at {addr:#x}+{len(data)} is outside a section")
        buf = self.rw.buf(sec)
        off = addr - sec.addr
        buf[off:off + len(data)] = data


def update_kernel_tables(rw, log, ctx=None, skip=(), only=None):
    """Apply update/write of every relayout-aware kernel table (but those in
    ``skip``; only those in ``only`` when given); returns counts."""
    image = rw.image
    if image.symbol_address("_stext") is None or rw.plan.is_identity():
        return {}
    from ...kernel import TABLES

    ctx = ctx or ImageContext.of(image, log=log)
    ctx._disasm = rw.dis if ctx._disasm is None else ctx._disasm
    out = PatchedImage(rw)
    done = {}
    for cls in TABLES:
        if cls.name not in RELAYOUT_TABLES or cls.name in skip or \
                (only is not None and cls.name not in only):
            continue
        table = cls()
        try:
            entries = table.parse(ctx)
        except Exception as e:          # noqa: BLE001 - report, do not hide
            rw.problems.append(("table-parse", 0, f"{cls.name}: {e}"))
            continue
        if not len(entries):
            continue
        try:
            new = table.update(ctx, entries, rw.amap)
        except NotImplementedError:
            rw.problems.append(("table-not-updated", 0, f"{cls.name}: no update for relayout"))
            log(f"warning: {cls.name} is not updated (no relayout support yet)")
            continue
        table.write(ctx, new, out)
        done[cls.name] = len(new)
        for k, v in sorted((getattr(table, "relayout_stats", None) or {}).items()):
            rw.stats[f"{cls.name}.{k}"] = v
        log(f"updated {cls.name}: {len(new)} entries")
    rw.stats.update({f"table.{k}": v for k, v in done.items()})
    return done
