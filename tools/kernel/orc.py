"""ORC unwind tables: ``.orc_unwind_ip`` (s32 relative IPs) and ``.orc_unwind``
(6-byte entries), parallel arrays sorted by IP at build time (sorttable); the
unwinder binary-searches them, so order is an invariant, and every IP must
be an instruction boundary (or the end of a code section: terminators).

``struct orc_entry {s16 sp_offset; s16 bp_offset; u16 bits}`` keeps its size,
but the bits changed (arch/x86/include/asm/orc_types.h):

- up to 6.3: ``sp_reg:4 bp_reg:4 type:2 end:1``; types CALL=0, REGS=1,
  REGS_PARTIAL=2; an undefined entry is ``sp_reg == ORC_REG_UNDEFINED``.
- 6.4 and later: ``sp_reg:4 bp_reg:4 type:3 signal:1``; types UNDEFINED=0,
  END_OF_STACK=1, CALL=2, REGS=3, REGS_PARTIAL=4; an undefined entry is
  ``type == ORC_TYPE_UNDEFINED`` (the all-zero entry is undefined in both).
  6.4+ also carries ``.orc_header`` (a 20-byte hash of orc_types.h that module
  loading compares), outside this table.
- 7.3 keeps the 6.4 bits but renumbered the registers (ORC_REG_AX = 1 is new,
  ORC_REG_BP_INDIRECT moved to 10, the highest): the check only bounds them by
  ORC_REG_MAX, relayout never reads them.
"""

import numpy as np

from ..image.coverage import PADDING
from .base import Finding, KernelTable, for_version, rel32_targets
from .patch_sites import in_patch_site

ORC_ENTRY = np.dtype([("sp_offset", "<i2"), ("bp_offset", "<i2"), ("bits", "<u2")])
ORC_TYPES = 3          # 6.1: CALL, REGS, REGS_PARTIAL
ORC_REG_MAX = 10
ORC_REG_UNDEFINED = 0


class OrcBits:
    """How one kernel version packs ``orc_entry.bits``."""

    def __init__(self, type_width, types, flag, undefined_by_type):
        self.type_width, self.types, self.flag = type_width, types, flag
        self.undefined_by_type = undefined_by_type

    def fields(self, bits):
        bits = np.asarray(bits).astype(np.int64)
        return bits & 0xF, (bits >> 4) & 0xF, (bits >> 8) & ((1 << self.type_width) - 1)

    def undefined(self, bits):
        sp_reg, _, typ = self.fields(bits)
        return (typ == 0) if self.undefined_by_type else (sp_reg == ORC_REG_UNDEFINED)


ORC_BITS = [((0, 0), OrcBits(2, ORC_TYPES, "end", False)),
            ((6, 4), OrcBits(3, 5, "signal", True))]


def orc_bits(ctx):
    return for_version(ORC_BITS, ctx.version)


class OrcTable(KernelTable):
    name = "orc_unwind"
    start_symbol = "__start_orc_unwind_ip"
    stop_symbol = "__stop_orc_unwind_ip"
    dtype = np.dtype("<i4")
    resorted_by_relayout = True
    relative_fields = (None,)

    def ranges(self, ctx):
        out = super().ranges(ctx)
        a = ctx.image.symbol_address("__start_orc_unwind")
        b = ctx.image.symbol_address("__stop_orc_unwind")
        if a is not None and b is not None:
            out.append((a, (b - a) // ORC_ENTRY.itemsize, ORC_ENTRY.itemsize))
        return out

    def parse(self, ctx):
        base, raw = self.raw(ctx)
        n = len(raw)
        ent = np.zeros(n, dtype=[("entry", "<u8"), ("ip", "<u8"), ("sp_offset", "<i2"),
                                 ("bp_offset", "<i2"), ("bits", "<u2")])
        if n == 0:
            return ent
        e = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(4)
        ent["entry"] = e
        ent["ip"] = rel32_targets(e, raw)
        a = ctx.image.symbol_address("__start_orc_unwind")
        b = ctx.image.symbol_address("__stop_orc_unwind")
        self._orc_count = (b - a) // ORC_ENTRY.itemsize if a is not None and b is not None else -1
        if self._orc_count == n:
            orc = ctx.image.view(a, n, ORC_ENTRY)
            for f in ("sp_offset", "bp_offset", "bits"):
                ent[f] = orc[f]
        return ent

    def check(self, ctx, entries):
        findings = []
        if self._orc_count != len(entries):
            findings.append(Finding("error", "orc.parallel", None,
                                    f".orc_unwind has {self._orc_count} entries but .orc_unwind_ip "
                                    f"has {len(entries)}"))
        ip = entries["ip"]
        self.check_sorted(ctx, findings, ip, "IPs")
        self.check_code_refs(ctx, findings, "ip", ip, allow_section_end=True,
                             allow_inside=in_patch_site, allow_padding=(PADDING,))
        layout = orc_bits(ctx)
        sp_reg, bp_reg, typ = layout.fields(entries["bits"])
        bad = (typ >= layout.types) | (sp_reg > ORC_REG_MAX) | (bp_reg > ORC_REG_MAX)
        self.report(findings, "error", "orc.entry", ip[bad],
                    lambda a: f"ORC entry for {ctx.symbol_at(a)} has an invalid register or type")
        return findings

    def check_window(self, ctx, entries, lo, hi):
        # the parallel-size check is about the whole table: done on every parse
        count, self._orc_count = self._orc_count, hi - lo
        try:
            findings = self.check(ctx, entries[lo:hi])
        finally:
            self._orc_count = count
        if count != len(entries):
            findings.append(Finding("error", "orc.parallel", None, "sizes differ"))
        return findings

    def update(self, ctx, entries, amap):
        """Relayout: map IPs, re-sort both arrays together, cover inserted padding.

        Several entries can land on one address (a terminator at a moved
        function's end and the next function's first entry): the function's
        own entry sorts last, since the unwinder takes the last entry <= IP.

        Padding the layout inserts (int3 runs between moved code) would inherit
        the state of the code before it; each run whose covering entry is not
        already an undefined-state entry gets one (sp_reg UNDEFINED, as
        objtool's terminators). The arrays have a fixed size, so room comes
        from entries that can never be found: IPs in dropped padding, and
        shadowed entries (an entry followed by one at the same IP:
        ``__orc_find`` returns the last entry <= IP). Runs for which there is no
        room keep no entry and are counted. ``self.relayout_stats`` says what
        happened.
        """
        if not amap.is_identity():
            # Any moved code: an entry at every moved piece. Mapping the old
            # entries alone is not enough: a function without an ORC entry of
            # its own (objtool omits an entry equal to the one before it) would
            # inherit the state of whatever precedes it in the new layout, e.g.
            # an inserted padding's undefined entry, and the unwinder stops there.
            return self._update_blocks(ctx, entries, amap)
        out = entries.copy()
        ip = entries["ip"]
        new_ip, ok = amap.map(ip)
        out["ip"] = new_ip
        own = ctx.functions.find(ip) >= 0
        # Entries for dropped padding (unmapped) are not kept at their old address.
        lost = ~np.asarray(ok, bool)
        order = np.lexsort((own.astype(np.int8), out["ip"]))
        lost = lost[order]
        out = out[order]
        stats = {"padding_runs": 0, "padding_runs_covered": 0, "padding_entries_added": 0,
                 "padding_runs_without_entry": 0, "dropped_unmapped": int(lost.sum()),
                 "dropped_shadowed": 0}
        runs = amap.padding_runs() if hasattr(amap, "padding_runs") else (np.zeros(0, np.uint64),)
        starts = np.asarray(runs[0], dtype=np.uint64)
        stats["padding_runs"] = int(len(starts))
        kept = out[~lost]
        if len(starts) and len(kept):
            j = np.searchsorted(kept["ip"], starts, side="right").astype(np.int64) - 1
            jc = np.maximum(j, 0)
            undefined = (j >= 0) & orc_bits(ctx).undefined(kept["bits"][jc])
            need = starts[~undefined]
            stats["padding_runs_covered"] = int(undefined.sum())
            free = int(lost.sum())
            shadowed = np.nonzero(kept["ip"][:-1] == kept["ip"][1:])[0]
            take = max(0, min(len(need) - free, len(shadowed)))
            if take:
                kept = np.delete(kept, shadowed[:take])
            stats["dropped_shadowed"] = int(take)
            n_add = min(len(need), free + take)
            add = np.zeros(n_add, dtype=out.dtype)
            add["ip"] = need[:n_add]                       # sp/bp offsets 0, bits 0: null state
            stats["padding_entries_added"] = int(n_add)
            stats["padding_runs_without_entry"] = int(len(need) - n_add)
            is_pad = np.concatenate((np.zeros(len(kept), np.int8), np.ones(n_add, np.int8)))
            merged = np.concatenate((kept, add))
            out = merged[np.lexsort((is_pad, merged["ip"]))]
        else:
            out = kept
        # Unused room (more lost entries than padding runs): repeat the last
        # entry (the final section terminator); duplicates are harmless.
        short = len(entries) - len(out)
        if short > 0:
            out = np.concatenate((out, np.repeat(out[-1:], short)))
        stats["padded_with_duplicates"] = max(short, 0)
        out["entry"] = entries["entry"]
        self.relayout_stats = stats
        return out

    def _update_blocks(self, ctx, entries, amap):
        """Relayout that moves code (function or block level): an entry at the new start of every moved piece
        (a copied block, a re-encoded branch, a unit moved whole) and every
        inserted jmp, with the state in effect at its original address (an
        inserted jmp runs in the state of the block it jumps to: its row's old
        address), an
        undefined entry at every padding run, then the table compacted: of
        several entries at one IP the last wins (what ``__orc_find`` returns),
        and an entry with the same state as the one before it is dropped (the
        lookup result does not change). The arrays keep their size: unused
        slots repeat the last entry."""
        stats = {}
        ip = entries["ip"]
        order0 = np.argsort(ip, kind="stable")
        sorted_ip = ip[order0]
        new_ip, ok = amap.map(ip)
        own = ctx.functions.find(ip) >= 0
        mapped = entries[ok].copy()
        mapped["ip"] = new_ip[ok]
        prio = np.where(own[ok], 2, 1).astype(np.int8)
        rows = amap.block_rows
        ins = rows[rows["kind"] == 2] if rows is not None else np.zeros(0, [("old", "<u8"), ("new", "<u8")])
        # every piece of the map (block-map rows and units moved whole: a function
        # without an ORC entry of its own would otherwise inherit the state of
        # whatever now precedes it) and every inserted jmp
        # (every piece, moved or not: one that stays may now follow new padding)
        moved = np.ones(len(amap.old_start), bool)
        if amap.new_end is not None:            # a removed jmp takes no new bytes
            moved &= amap.new_end > amap.new_start
        old_at = np.concatenate((amap.old_start[moved], ins["old"].astype(np.uint64)))
        new_at = np.concatenate((amap.new_start[moved], ins["new"].astype(np.uint64)))
        j = np.searchsorted(sorted_ip, old_at, side="right").astype(np.int64) - 1
        has = j >= 0
        src = entries[order0[np.maximum(j, 0)]][has]
        added = src.copy()
        added["ip"] = new_at[has]
        pads = amap.padding_runs()[0]
        # The table has a fixed size. Entries at moved pieces are what keeps the
        # unwinder right; the undefined entries at inserted padding (int3 fill that
        # never runs) are the ones given up when there is no room.
        keep_pad = np.ones(len(pads), bool)
        for _ in range(4):
            # an entry mapped to a dropped run's start (a piece's old end) would only
            # cover that padding: it goes with the run
            m = ~np.isin(mapped["ip"], pads[~keep_pad])
            out, from_pad = self._merge_compact(entries.dtype, added, mapped[m], prio[m],
                                                pads[keep_pad])
            excess = len(out) - len(entries)
            if excess <= 0:
                break
            kept_ips = out["ip"][from_pad]
            drop = np.isin(pads, kept_ips[:excess]) & keep_pad
            if not drop.any():
                break
            keep_pad &= ~drop
        stats.update({"block_entries_wanted": int(has.sum()), "dropped_unmapped": int((~ok).sum()),
                      "padding_runs": int(len(pads)),
                      "padding_runs_without_entry": int((~keep_pad).sum()),
                      "entries_before": int(len(entries)), "entries_after": int(len(out))})
        if len(out) > len(entries):
            raise ValueError(f"ORC: the layout needs {len(out)} entries, the table holds "
                             f"{len(entries)}")
        short = len(entries) - len(out)
        if short > 0:
            out = np.concatenate((out, np.repeat(out[-1:], short)))
        stats["padded_with_duplicates"] = int(max(short, 0))
        out["entry"] = entries["entry"]
        self.relayout_stats = stats
        return out

    @staticmethod
    def _merge_compact(dtype, added, mapped, prio, pads):
        """Sorted, compacted entries (and which came from padding): at one IP the
        last wins, a piece's own entry (the state at its original start) over
        everything else (an entry mapped there from elsewhere, the end of the piece
        before it in the original or a point inside a re-encoded branch, can be
        stale); an entry with the state of the one before it is dropped."""
        pad = np.zeros(len(pads), dtype=dtype)
        pad["ip"] = pads
        merged = np.concatenate((added, mapped, pad))
        pr = np.concatenate((np.full(len(added), 4, np.int8), prio, np.full(len(pad), 3, np.int8)))
        o = np.lexsort((pr, merged["ip"]))
        merged, pr = merged[o], pr[o]
        last_at_ip = np.ones(len(merged), bool)
        last_at_ip[:-1] = merged["ip"][:-1] != merged["ip"][1:]
        merged, pr = merged[last_at_ip], pr[last_at_ip]
        state = merged[["sp_offset", "bp_offset", "bits"]]
        same = np.zeros(len(merged), bool)
        same[1:] = (state[1:] == state[:-1])
        return merged[~same], pr[~same] == 3

    def write(self, ctx, entries, out):
        if not len(entries):
            return
        e = entries["entry"].astype(np.int64)
        rel = (entries["ip"].astype(np.int64) - e).astype("<i4")
        out.write(int(entries["entry"][0]), rel.view(np.uint8))
        a = ctx.image.symbol_address("__start_orc_unwind")
        orc = np.zeros(len(entries), dtype=ORC_ENTRY)
        for f in ("sp_offset", "bp_offset", "bits"):
            orc[f] = entries[f]
        out.write(a, orc.view(np.uint8))
