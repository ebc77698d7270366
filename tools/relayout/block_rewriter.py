"""The rewriter for block-level layouts.

Same passes as ``Rewriter`` (relocated fields, assembler-resolved branches,
RIP-relative operands, symbols) through an AddressMap that has one piece per
block-map row inside split functions and one per unit elsewhere. Differences:
split functions' parts are written from their emitted bytes (re-encoded
branches already carry their final displacement), so the branch pass skips
the instructions the split re-encoded or removed, and the static-key census
reads the new bytes.
"""

import numpy as np

from ..image import blockmap as bm
from ..image.addrmap import AddressMap, plan_extents, units_of_extents
from .rewriter import Rewriter, RewriteError


class BlockRewriter(Rewriter):
    def __init__(self, image, units, plan, unit_disasm, rows, part_bytes, split_mask, log=None):
        self.rows = rows
        self.part_bytes = part_bytes           # planning unit index -> bytes
        self.split_mask = split_mask           # planning units emitted from part bytes
        super().__init__(image, units, plan, unit_disasm, log=log)

    def address_map(self):
        u, plan, rows, split_mask = self.units, self.plan, self.rows, self.split_mask
        extents, anchors = plan_extents(plan)
        keep = ~split_mask & units_of_extents(u, extents)
        base = AddressMap(u.start[keep], u.end[keep], plan.new_start[keep], extents, anchors)
        amap = bm.address_map(rows, base=base)
        ins = rows[rows["kind"] == bm.KIND_JMP_INSERTED]
        amap.occupied = (ins["new"].astype(np.uint64),
                         ins["new"].astype(np.uint64) + ins["new_len"].astype(np.uint64))
        amap.block_rows = rows
        return amap

    def unit_bytes(self, i, old, sec):
        """A split function's part comes from its emitted bytes (re-encoded
        branches already carry their final displacement); other units move whole."""
        if self.split_mask[i]:
            return np.frombuffer(self.part_bytes[i], np.uint8)
        return super().unit_bytes(i, old, sec)

    def fix_branches(self):
        """Assembler-resolved branches, except the ones the split re-encoded
        (written with their final displacement) or removed."""
        r = self.rows
        done = np.sort(r["old"][(r["kind"] == bm.KIND_BRANCH) | (r["kind"] == bm.KIND_JMP_REMOVED)]
                       .astype(np.uint64))
        dis = self.dis
        orig = dis.branch_targets

        def filtered():
            idx, target, kind = orig()
            keep = ~np.isin(dis.addr[idx], done)
            return idx[keep], target[keep], kind[keep]
        dis.branch_targets = filtered
        try:
            super().fix_branches()
        finally:
            del dis.branch_targets

    def check_static_keys(self):
        """Census of static-key sites after the split: each site's new form
        (from the new bytes), its reach, and what changed."""
        from ..image.context import ImageContext
        from ..kernel.jump_table import JumpTable, classify, rel8_reach
        if self.image.symbol_address("__start___jump_table") is None:
            return
        ctx = ImageContext.of(self.image)
        e = JumpTable().parse(ctx)
        if not len(e):
            return
        kind_old, _ = classify(ctx, e["code"])
        code_n, _ = self.amap.map(e["code"])
        tgt_n, _ = self.amap.map(e["target"])
        kind_new = np.empty(len(e), np.int8)
        for i, a in enumerate(code_n.tolist()):
            sec = self.image.section_at(a)
            buf = self.patched.get(sec.index) if sec is not None else None
            b = bytes(buf[a - sec.addr:a - sec.addr + 5]) if buf is not None else \
                bytes(self.image.read(a, 5))
            kind_new[i] = (0 if b[:2] == b"\x66\x90" else 1 if b == b"\x0f\x1f\x44\x00\x00"
                           else 2 if b[0] == 0xEB else 3 if b[0] == 0xE9 else 4)
        short_old = (kind_old == 0) | (kind_old == 2)
        short_new = (kind_new == 0) | (kind_new == 2)
        bad = short_new & ~rel8_reach(code_n, tgt_n)
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise RewriteError(f"{int(bad.sum())} 2-byte static-key site(s) do not reach their "
                               f"target after the split (first {int(e['code'][i]):#x})")
        if (kind_new == 4).any():
            raise RewriteError(f"{int((kind_new == 4).sum())} static-key site(s) hold no "
                               "nop2/nop5/jmp8/jmp32 after the split")
        sem_old = (kind_old == 2) | (kind_old == 3)
        sem_new = (kind_new == 2) | (kind_new == 3)
        if (sem_old != sem_new).any():
            raise RewriteError("a static-key site changed between nop and jmp in the split")
        self.stats["static_keys.sites_rechecked"] = int(len(e))
        self.stats["static_keys.made_short"] = int((~short_old & short_new).sum())
        self.stats["static_keys.made_long"] = int((short_old & ~short_new).sum())
        self.stats["static_keys.unchanged"] = int((short_old == short_new).sum())
        self.stats["static_keys.two_byte"] = int(short_new.sum())
        self.stats["static_keys.five_byte"] = int((~short_new).sum())
        self.stats["static_keys.five_byte_in_rel8_reach"] = int(
            (~short_new & rel8_reach(code_n, tgt_n)).sum())
