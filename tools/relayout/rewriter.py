"""Rewrite an ET_EXEC linked with --emit-relocs according to a LayoutPlan.

1. Copy each unit's bytes to its new place; fill the rewritten extents with
   int3 (0xcc) first.
2. Fix every relocated field (in code or data) whose field moved or whose
   target moved. The field's current bytes are the truth for the target
   (relocations of tables sorted after the link can be stale):
   PC-relative: T = end + disp, where end is the end of the instruction that
   holds the field (data: the field itself); new value map(T) - new end.
   Absolute: T = value; new value map(T).
   A non-SECTION symbol drags its target with it (``foo+size``,
   ``sym - __START_KERNEL_map``); a SECTION symbol's target is mapped directly.
3. Fix assembler-resolved references (no relocation): direct jmp/jcc/call
   rel8/rel32 and RIP-relative operands, found by disassembling every unit.
4. Update the relocation sections (r_offset of moved fields, addends that
   encode moved targets), the symbol table and the entry point.
"""

import numpy as np

from ..errors import LinepackError
from ..image.addrmap import AddressMap
from ..image.context import ImageContext
from ..image.elf import RELA, SHT_SYMTAB, STT_SECTION, SYM
from ..image.relocs import (ABS_TYPES, GOT_TYPES, PC_TYPES, RECIPES, RELOC_NAMES, R_X86_64_32,
                             R_X86_64_32S, R_X86_64_64, R_X86_64_NONE, R_X86_64_PC32,
                             R_X86_64_PLT32, TLS_NAMES, tls_effective_types)

STT_GNU_IFUNC = 10
TLS_TYPES = list(TLS_NAMES)


_RIP_ROWS = 1 << 15     # rows per slice in fix_rip_relative's candidate search


class RewriteError(LinepackError):
    pass


def _read_int(buf, pos, size, signed):
    """Little-endian ints at positions pos (int64 array) of a uint8 array."""
    v = np.zeros(len(pos), dtype=np.uint64)
    for k in range(size):
        v |= buf[pos + k].astype(np.uint64) << np.uint64(8 * k)
    if signed:
        if size == 4:
            return v.astype(np.uint32).view(np.int32).astype(np.int64)
        return v.view(np.int64)
    return v


def _write_int(buf, pos, values, size):
    vals = np.asarray(values).astype(np.int64).view(np.uint64)
    for k in range(size):
        buf[pos + k] = ((vals >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8)


class Rewriter:
    def __init__(self, image, units, plan, unit_disasm=None, log=None):
        self.image = image
        self.units = units
        self.plan = plan
        self.log = log or (lambda m: None)
        self.amap = self.address_map()
        self.dis = unit_disasm
        self.patched = {}            # section index -> np.uint8 array (new contents)
        self.stats = {}
        self.problems = []           # (kind, address, message)
        syms = image.symtab
        self.sym_value = syms["value"].astype(np.uint64)
        self.sym_type = (syms["info"] & 0xF).astype(np.int64)
        self.sym_new = None
        self.pic_tables = None       # PIC switch-table entries, loose fields (relayout/user/pie.py)
        self.block_split = None      # block level: the split (relayout/passes.py)
        self.header_updates = None   # {section index: {header field: value}} for write_image
        self.section_moves = None    # {section index: (new address, new size)} for write_image
        # {section index: (new address, new size)}: laid-out sections whose moved code
        # goes to a new segment (relayout/user/segment.py); their old bytes (pinned
        # code stays there) are in ``self.orig``
        self.relocated = {}
        self.orig = {}
        self._anchor_padding_labels()

    def _anchor_padding_labels(self):
        """A symbol whose value lies in padding the layout drops names no byte: a
        label of code configured out (7.3 without CONFIG_FINEIBT_BHI: the empty
        array ``__bhi_args`` .. ``__bhi_args_end`` between two functions). It keeps
        its distance from the function before it, as ``verify --against`` maps code
        between functions, so labels of one gap keep their differences (an empty
        range stays empty) and fields that designate it follow it."""
        amap, v = self.amap, self.sym_value
        shndx = self.image.symtab["shndx"]
        sel = (self.sym_type != STT_SECTION) & (shndx != 0) & (shndx < 0xFF00)
        v = np.unique(v[sel])
        v = v[amap.in_extent(v)]
        _, ok = amap.map(v)
        lost = v[~ok]
        if not len(lost):
            return
        fstart = ImageContext.of(self.image).functions.start
        i = np.searchsorted(fstart, lost, side="right").astype(np.int64) - 1
        has = i >= 0
        lost, base = lost[has], fstart[i[has]]
        new_base, ok = amap.map(base)
        lost, base, new_base = lost[ok], base[ok], new_base[ok]
        if not len(lost):
            return
        anchors = dict(zip(amap.anchor_old.tolist(), amap.anchor_new.tolist()))
        delta = new_base.astype(np.int64) - base.astype(np.int64)
        moved = (lost.astype(np.int64) + delta).view(np.uint64)
        anchors.update(zip(lost.tolist(), moved.tolist()))
        keys = sorted(anchors)
        amap.anchor_old = np.array(keys, dtype=np.uint64)
        amap.anchor_new = np.array([anchors[k] for k in keys], dtype=np.uint64)
        self.stats["padding_labels"] = int(len(lost))

    # -- helpers -------------------------------------------------------------
    def address_map(self):
        return AddressMap.from_plan(self.plan)

    def buf(self, sec):
        if sec.index not in self.patched:
            if sec.index in self.relocated:
                self.patched[sec.index] = np.full(self.relocated[sec.index][1], 0xCC, np.uint8)
                self.orig[sec.index] = np.array(self.image.section_bytes(sec), dtype=np.uint8)
            else:
                self.patched[sec.index] = np.array(self.image.section_bytes(sec), dtype=np.uint8)
        return self.patched[sec.index]

    def out_at(self, addr):
        """(buffer, its address) of the output bytes that hold new address ``addr``:
        a relocated section's new place, its old place, or an unmoved section."""
        for i, (a, n) in self.relocated.items():
            if a <= addr < a + n:
                return self.buf(self.image.sections[i]), a
        sec = self.image.section_at(addr)
        buf = self.buf(sec)
        return (self.orig[sec.index] if sec.index in self.relocated else buf), sec.addr

    def write_fields(self, addrs, values, size):
        """Write ``size``-byte fields at new addresses (any output section)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        values = np.asarray(values, dtype=np.int64)
        if not len(addrs):
            return
        lo = int(addrs.min())
        buf, base = self.out_at(lo)
        inside = (addrs >= np.uint64(base)) & (addrs + np.uint64(size) <= np.uint64(base + len(buf)))
        _write_int(buf, (addrs[inside] - np.uint64(base)).astype(np.int64), values[inside], size)
        if not inside.all():
            self.write_fields(addrs[~inside], values[~inside], size)

    def problem(self, kind, addrs, what):
        addrs = np.asarray(addrs, dtype=np.uint64)
        for a in addrs[:5].tolist():
            self.problems.append((kind, a, what))
        if len(addrs):
            self.stats[f"problem.{kind}"] = self.stats.get(f"problem.{kind}", 0) + int(len(addrs))

    def _other_code_disasm(self):
        """Linear-sweep disassembly of code sections the layout does not touch."""
        from ..image.elf import code_sections
        laid = {r.section for r in self.units.regions}
        secs = [s for s in code_sections(self.image) if s.index not in laid]
        if not secs:
            return None
        # the same for every layout of an image: decoded once per image object
        return ImageContext.of(self.image).swept(secs)

    def insn_end(self, addrs, in_code):
        """End of the instruction holding each address (code), else the address itself."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        end = addrs.copy()
        found = np.zeros(len(addrs), bool)
        for dis in (self.dis, self.other_dis):
            if dis is None or not len(dis):
                continue
            i = dis.containing(addrs)
            ok = (i >= 0) & in_code & ~found
            ic = np.maximum(i, 0)
            end = np.where(ok, dis.addr[ic] + dis.size[ic].astype(np.uint64), end)
            found |= ok
        return end, found

    # -- the rewrite: steps the relayout passes call in order (relayout/passes.py) --

    def refresh_leftover_relocations(self):
        """References recovered from a vmlinuz: the few link relocation sections
        the kernel's build left in the vmlinux (Debian 6.12: those of the
        runtime-constant tables, ``.relaruntime_ptr_*``) were not used, so their
        addends still describe the old layout. Each gets the addend that says
        what its data field now holds (the field itself was rewritten from the
        recovered references)."""
        if ImageContext.of(self.image).recovered is None:
            return
        from ..image.elf import RELA, SHT_RELA
        fields = {R_X86_64_64: (8, False), R_X86_64_PC32: (4, True), R_X86_64_PLT32: (4, True),
                  R_X86_64_32: (4, False), R_X86_64_32S: (4, False)}
        fixed = 0
        for rs in self.image.sections:
            if rs.type != SHT_RELA or not rs.size:
                continue
            tgt = self.image.sections[rs.info]
            if not tgt.is_alloc or tgt.is_code or tgt.type == 8:
                continue
            rows = np.array(self.image.section_bytes(rs)).view(RELA).copy()
            data = self.buf(tgt)
            sym = (rows["info"] >> np.uint64(32)).astype(np.int64)
            rtype = (rows["info"] & np.uint64(0xFFFFFFFF)).astype(np.int64)
            changed = False
            for k in range(len(rows)):
                f = fields.get(int(rtype[k]))
                off = int(rows["offset"][k]) - tgt.addr
                if f is None or sym[k] == 0 or not 0 <= off <= tgt.size - f[0]:
                    continue
                size, pcrel = f
                signed = size == 4 and (pcrel or rtype[k] == R_X86_64_32S)
                val = int.from_bytes(bytes(data[off:off + size]), "little", signed=signed)
                S = int(self.sym_new[sym[k]])
                want = (val + (int(rows["offset"][k]) if pcrel else 0) - S) % (1 << 64)
                want = want - (1 << 64) if want >= 1 << 63 else want
                if want != int(rows["addend"][k]):
                    rows["addend"][k] = want
                    changed = True
                    fixed += 1
            if changed:
                self.patched[rs.index] = rows.view(np.uint8)
        if fixed:
            self.stats["relocations.leftover_refreshed"] = fixed

    def check_static_keys(self):
        """Re-check every ``__jump_table`` site against its new target.

        A site keeps its size (whole units move): a 2-byte site (``66 90`` /
        ``eb rel8``) must still reach its target with rel8, else the layout
        separated the two and the kernel would patch a wrong jump: that is an
        error, not something to fix up here. 5-byte sites whose target is now in
        rel8 reach are counted (re-encoding them changes function sizes: the
        block-level rewriter's job). Kernels before 5.14 never get a 2-byte site.
        """
        from ..kernel.jump_table import SHORT_SITES_SINCE, JumpTable, classify, rel8_reach
        if self.image.symbol_address("__start___jump_table") is None:
            return
        ctx = ImageContext.of(self.image)
        jt = JumpTable()
        e = jt.parse(ctx)
        if not len(e):
            return
        kind, _ = classify(ctx, e["code"])           # the original bytes decide the size
        code_n, _ = self.amap.map(e["code"])
        tgt_n, _ = self.amap.map(e["target"])
        short = (kind == 0) | (kind == 2)
        reach = rel8_reach(code_n, tgt_n)
        bad = np.nonzero(short & ~reach)[0]
        if len(bad):
            i = int(bad[0])
            d = int(tgt_n[i]) - (int(code_n[i]) + 2)
            raise RewriteError(
                f"{len(bad)} 2-byte static-key site(s) would not reach their target after "
                f"relayout: first {ctx.symbol_at(int(e['code'][i]))} ({int(e['code'][i]):#x} -> "
                f"{int(code_n[i]):#x}) jumps to {ctx.symbol_at(int(e['target'][i]))} "
                f"({int(tgt_n[i]):#x}), displacement {d} is outside rel8; the layout must "
                "keep a site and its target together")
        if ctx.version is not None and ctx.version[:2] < SHORT_SITES_SINCE and short.any():
            self.problem("short-static-key-on-old-kernel", e["code"][short],
                         "2-byte static-key site in a kernel older than 5.14 (input)")
        self.stats["static_keys.sites_rechecked"] = int(len(e))
        self.stats["static_keys.two_byte"] = int(short.sum())
        self.stats["static_keys.five_byte"] = int(((kind == 1) | (kind == 3)).sum())
        self.stats["static_keys.five_byte_in_rel8_reach"] = int(
            (((kind == 1) | (kind == 3)) & reach).sum())
        self.stats["static_keys.illegal"] = int((kind == 4).sum())

    def move_code(self):
        u, p = self.units, self.plan
        moved = 0
        for lo, hi in zip(self.amap.ext_lo.tolist(), self.amap.ext_hi.tolist()):
            sec = self.image.section_at(lo)
            old = self.image.section_bytes(sec)
            new = self.buf(sec)
            base = sec.addr
            inside = (u.start >= np.uint64(lo)) & (u.start < np.uint64(hi))
            idx = np.nonzero(inside)[0]
            if sec.index in self.relocated:
                # the old place keeps only its pinned code: int3 where code left
                self.orig[sec.index][lo - sec.addr:hi - sec.addr] = 0xCC
                base, n = self.relocated[sec.index]
                hi = base + n
            elif len(idx) and int(p.new_end[idx].max()) > hi:
                raise RewriteError(f"layout runs past {hi:#x} (end of section {sec.name} "
                                   "or pinned code)")
            else:
                new[lo - sec.addr:hi - sec.addr] = 0xCC
            if len(idx) and int(p.new_end[idx].max()) > hi:
                raise RewriteError(f"layout runs past {hi:#x} (end of the new {sec.name})")
            for i in idx.tolist():
                b = int(p.new_start[i]) - base
                data = self.unit_bytes(i, old, sec)
                new[b:b + len(data)] = data
            moved += int(p.moved[idx].sum())
        self.stats["units_moved"] = moved

    def unit_bytes(self, i, old, sec):
        """The bytes unit ``i`` takes to its new place: its original ones (``old``:
        its section's contents)."""
        a = int(self.units.start[i]) - sec.addr
        return old[a:a + int(self.units.size[i])]

    def new_symbols(self):
        """New value of every symbol (unchanged outside the rewritten extents)."""
        v = self.sym_value
        new, ok = self.amap.map(v)
        in_ext = self.amap.in_extent(v)
        sec_sym = self.sym_type == STT_SECTION
        # NOTYPE labels at a region boundary follow the region, not the unit there.
        anchors = dict(zip(self.amap.anchor_old.tolist(), self.amap.anchor_new.tolist()))
        label = (self.sym_type == 0) & in_ext
        if anchors:
            aold = np.array(sorted(anchors), dtype=np.uint64)
            anew = np.array([anchors[a] for a in sorted(anchors)], dtype=np.uint64)
            j = np.searchsorted(aold, v)
            jc = np.minimum(j, len(aold) - 1)
            at = label & (j < len(aold)) & (aold[jc] == v)
            new = np.where(at, anew[jc], new)
            ok |= at
        shndx = self.image.symtab["shndx"]
        abs_or_undef = (shndx == 0) | (shndx >= 0xFF00)
        keep = sec_sym | abs_or_undef | ~in_ext
        new = np.where(keep, v, new)
        bad = ~keep & ~ok
        if bad.any():
            self.problem("symbol-in-padding", v[bad], "symbol value in dropped padding")
            new = np.where(bad, v, new)
        for i, (a, _) in self.relocated.items():
            # a relocated section's SECTION symbol names its new place (relocations
            # against it get their addends adjusted by fix_relocations)
            new = np.where(sec_sym & (shndx == i), np.uint64(a), new)
        self.sym_new = new
        self.stats["symbols_updated"] = int((new != v).sum())

    def _target_rule(self, T, S, S_new, is_sec):
        """New targets. A SECTION symbol's target is mapped (the addend encodes
        the place). A named symbol carries its target with it, as the linker
        computed S + A: T moves by exactly as much as S (``foo+size``,
        ``sym - __START_KERNEL_map``, and ``_text+0xfff`` = PFN_ALIGN(_text) in
        mark_rodata_ro, whose T lands inside some moved function but means
        "_text's page", not that function)."""
        Tm, ok = self.amap.map(T)
        dS = S_new.astype(np.int64) - S.astype(np.int64)
        drag = ~is_sec
        out = np.where(drag, (T.astype(np.int64) + dS).astype(np.uint64), Tm)
        return out, ok | drag

    def fix_relocations(self):
        image = self.image
        total = {"relocs": 0, "fields_changed": 0, "offsets_moved": 0, "stale": 0}
        for name, rel in image.relocations.items():
            tgt = rel.target
            if not tgt.is_alloc or not len(rel):
                continue
            typ = rel.type.astype(np.int64)
            P = rel.offset.astype(np.uint64)
            if tgt.is_code and np.isin(typ, TLS_TYPES).any():
                # TLS accesses as ld left them: constants, or a GOT slot's reach
                typ, unrelaxed = tls_effective_types(typ, P, image.section_bytes(tgt), tgt.addr)
                if len(unrelaxed):
                    raise RewriteError(
                        f"{name}: {len(unrelaxed)} general- or local-dynamic TLS accesses "
                        f"the linker did not relax (first at {int(unrelaxed[0]):#x}): a shared "
                        f"object's code, which relayout does not rewrite")
            sym = rel.sym.astype(np.int64)
            A = rel.addend.astype(np.int64)
            S = self.sym_value[sym]
            S_new = self.sym_new[sym]
            is_sec = self.sym_type[sym] == STT_SECTION
            P_new, P_ok = self.amap.map(P) if tgt.is_code else (P, np.ones(len(P), bool))
            if not P_ok.all():
                self.problem("reloc-field-in-padding", P[~P_ok], f"{name}: field in padding")
            known = np.isin(typ, list(PC_TYPES) + list(ABS_TYPES) + [R_X86_64_NONE])
            if not known.all():
                bad_types = sorted({RELOC_NAMES.get(int(t), str(int(t))) for t in typ[~known]})
                # Unknown types are fine where nothing moves.
                mv = (P_new != P) & ~known
                if mv.any():
                    raise RewriteError(f"{name}: relocation types {bad_types} in moved code")
            buf = self.buf(tgt)
            old_buf = image.section_bytes(tgt)
            off = (P - np.uint64(tgt.addr)).astype(np.int64)
            off_new = (P_new - np.uint64(tgt.addr)).astype(np.int64)
            newA = A.copy()
            changed_fields = 0
            stale = 0
            for t, size in list(PC_TYPES.items()) + list(ABS_TYPES.items()):
                m = np.nonzero(typ == t)[0]
                if not len(m):
                    continue
                pc = t in PC_TYPES
                field = _read_int(old_buf, off[m], size, signed=RECIPES[t].signed)
                if pc:
                    end, _ = self.insn_end(P[m], np.full(len(m), tgt.is_code))
                    if not tgt.is_code and self.pic_tables is not None:
                        # a PIC switch-table entry is relative to its table's base
                        end, _ = self.pic_tables.anchor(end)
                    T = (end.astype(np.int64) + field).astype(np.uint64)
                    T_rel = (S[m].astype(np.int64) + A[m] + (end - P[m]).astype(np.int64)
                             ).astype(np.uint64)
                    if t in GOT_TYPES:       # the GOT slot (or the relaxed target)
                        T_rel = T
                else:
                    T = field.astype(np.int64).astype(np.uint64) if t == R_X86_64_32S else \
                        field.astype(np.uint64)
                    T_rel = (S[m].astype(np.int64) + A[m]).astype(np.uint64)
                    if t == R_X86_64_32:
                        T_rel = T_rel & np.uint64(0xFFFFFFFF)
                    if t == R_X86_64_32S:
                        T_rel = T_rel.view(np.int64).astype(np.int32).astype(np.int64).view(np.uint64)
                stale += int((T != T_rel).sum())
                # the field reaches a stub or slot ld made, not the symbol: a GOT slot
                # (GOTPCREL left unrelaxed) or an ifunc's PLT entry; it does not move
                # with the symbol (mapped like a SECTION target: left where it is)
                direct = is_sec[m] | (self.sym_type[sym[m]] == STT_GNU_IFUNC)
                if t in GOT_TYPES:
                    direct |= ~self.amap.in_extent(T)
                Tn, ok = self._target_rule(T, S[m], S_new[m], direct)
                loose = None
                if pc and not tgt.is_code and self.pic_tables is not None:
                    # a PC-relative data field nothing explains: left as it is (the
                    # functions it may designate are pinned: relayout/user/pie.py)
                    loose = self.pic_tables.is_loose(P[m])
                    Tn, ok = np.where(loose, T, Tn), ok | loose
                if not ok.all():
                    self.problem("target-in-padding", T[~ok], f"{name}: target in dropped padding")
                # the rule is per element: map again only where the relocation's own
                # target differs from the field's (stale entries)
                Tn_rel = Tn
                differ = np.nonzero(T_rel != T)[0]
                if len(differ):
                    Tn_rel = Tn.copy()
                    Tn_rel[differ], _ = self._target_rule(T_rel[differ], S[m][differ],
                                                          S_new[m][differ], direct[differ])
                if loose is not None and loose.any():
                    Tn_rel = np.where(loose, T_rel, Tn_rel)
                dP = P_new[m].astype(np.int64) - P[m].astype(np.int64)
                if pc:
                    end_new = (end.astype(np.int64) + dP)
                    val = Tn.astype(np.int64) - end_new
                    if t not in GOT_TYPES:
                        newA[m] = A[m] + (Tn_rel.astype(np.int64) - T_rel.astype(np.int64)) \
                            - (S_new[m].astype(np.int64) - S[m].astype(np.int64))
                    if size == 4:
                        over = (val < -2**31) | (val >= 2**31)
                        if over.any():
                            self.problem("pc32-overflow", P[m][over], f"{name}: PC32 overflow")
                else:
                    val = Tn.astype(np.int64)
                    if not tgt.is_code and size == 8:
                        # a data field the linker left 0 for the loader to fill from a
                        # dynamic relocation's addend (lld's PIEs: RELA fields are not
                        # written without --apply-dynamic-relocs): it stays 0 (the addend
                        # follows the layout, pie.py); read as S + A it would get the
                        # symbol's move added to 0
                        val = np.where((field == 0) & (T_rel != 0), 0, val)
                    newA[m] = A[m] + (Tn_rel.astype(np.int64) - T_rel.astype(np.int64)) \
                        - (S_new[m].astype(np.int64) - S[m].astype(np.int64))
                oldv = field.astype(np.int64)
                diff = (val != oldv) | (dP != 0)
                if diff.any():
                    sel = m[diff]
                    if tgt.index in self.relocated:
                        self.write_fields(P_new[sel], val[diff], size)
                    else:
                        _write_int(buf, off_new[sel], val[diff], size)
                    changed_fields += int((val != oldv).sum())
            total["relocs"] += len(rel)
            total["fields_changed"] += changed_fields
            total["stale"] += stale
            if stale:
                self.stats[f"stale.{name}"] = stale
            moved_off = P_new != P
            total["offsets_moved"] += int(moved_off.sum())
            # recovered references (image/references.py) have no .rela section to update
            if rel.section is not None and (moved_off.any() or (newA != A).any()):
                rows = np.array(image.section_bytes(rel.section)).view(RELA).copy()
                rows["offset"] = P_new
                rows["addend"] = newA
                self.patched[rel.section.index] = rows.view(np.uint8)
        self.stats.update({f"relocations.{k}": v for k, v in total.items()})

    def _reloc_covered(self, dis):
        """Instruction indices of ``dis`` that hold a relocated field."""
        rel = self.image.relocations
        cover = np.zeros(len(dis), bool)
        for r in rel.values():
            if r.target.is_code and len(r):
                i = dis.containing(r.offset.astype(np.uint64))
                cover[i[i >= 0]] = True
        return cover

    def fix_branches(self):
        dis = self.dis
        if dis is None:
            raise RewriteError("internal: no disassembly of the units")
        # loop/jecxz (rel8) and xbegin (rel32) too; a rel16 xbegin (kind 2) is not
        # fixed (verify names it if it moved away from its target)
        idx, target, kind = dis.pc_relative_branches()
        covered = self._reloc_covered(dis)
        keep = ~covered[idx]
        idx, target, kind = idx[keep], target[keep], kind[keep]
        addr = dis.addr[idx]
        size = dis.size[idx].astype(np.uint64)
        end = addr + size
        new_addr, ok_a = self.amap.map(addr)
        Tn, ok = self.amap.map(target)
        end_new = new_addr + size
        disp_new = Tn.astype(np.int64) - end_new.astype(np.int64)
        disp_old = target.astype(np.int64) - end.astype(np.int64)
        change = disp_new != disp_old
        bad = change & ~ok
        if bad.any():
            self.problem("branch-into-padding", addr[bad], "branch target in dropped padding")
        for k, name in ((1, "rel8"), (4, "rel32")):
            m = change & (kind == k) & ok
            lim = 2 ** (8 * k - 1)
            over = m & ((disp_new < -lim) | (disp_new >= lim))
            if over.any():
                raise RewriteError(f"{int(over.sum())} {name} branches overflow after relayout "
                                   f"(first at {int(addr[over][0]):#x})")
            sel = np.nonzero(m)[0]
            if len(sel):
                self.write_fields(end_new[sel] - np.uint64(k), disp_new[sel], k)
            self.stats[f"branches.{name}_fixed"] = int(m.sum())

    def fix_rip_relative(self):
        """RIP-relative operands without a relocation (same-section references)."""
        from ..image.operands import rip_relative
        dis = self.dis
        raw = dis.raw
        # a relocation at the displacement fixes it; one elsewhere in the instruction
        # (a relocated immediate: cmpq $sym, x(%rip)) does not
        rel_fields = np.unique(np.concatenate(
            [r.offset.astype(np.uint64) for r in self.image.relocations.values()
             if r.target.is_code and len(r)] or [np.zeros(0, np.uint64)]))
        cand = np.zeros(len(dis), bool)
        text_lo = min(r.start for r in self.units.regions)
        text_hi = max(r.end for r in self.units.regions)
        # candidates: a mod=00 rm=101 ModRM byte right before a 4-byte displacement
        # (followed by 0, 1, 2 or 4 immediate bytes) that points into the laid-out text;
        # a slice of rows at a time (per-row int64 temporaries over all of an image's
        # rows were the rewrite's memory peak: zstd +11 MiB)
        for lo in range(0, len(dis), _RIP_ROWS):
            hi = min(lo + _RIP_ROWS, len(dis))
            size = dis.size[lo:hi].astype(np.int64)
            flat = raw[lo:hi].reshape(-1)
            base = np.arange(hi - lo, dtype=np.int64) * raw.shape[1]
            for imm in (0, 1, 2, 4):
                dpos = size - 4 - imm
                mpos = np.maximum(dpos - 1, 0)
                modrm = flat[base + np.minimum(mpos, 15)]
                i = np.nonzero((dpos >= 1) & ((modrm & 0xC7) == 0x05))[0]
                # (the relocation lookup on these rows only: a tenth of them)
                if len(rel_fields):
                    field = dis.addr[lo + i] + dpos[i].astype(np.uint64)
                    k = np.minimum(np.searchsorted(rel_fields, field), len(rel_fields) - 1)
                    i = i[rel_fields[k] != field]
                disp = np.zeros(len(i), np.int64)
                for k in range(4):
                    disp |= flat[base[i] + np.clip(dpos[i] + k, 0, 15)].astype(np.int64) << (8 * k)
                disp = np.where(disp >= 2**31, disp - 2**32, disp)
                T = dis.addr[lo + i] + size[i].astype(np.uint64) + disp.view(np.uint64)
                cand[lo + i[(T >= np.uint64(text_lo)) & (T < np.uint64(text_hi))]] = True
        idx = np.nonzero(cand)[0]
        size = dis.size[idx].astype(np.int64)
        rip, do = rip_relative(raw[idx], size)
        if len(rel_fields):         # a candidate read at another offset: the real one counts
            field = dis.addr[idx] + do.astype(np.uint64)
            k = np.minimum(np.searchsorted(rel_fields, field), len(rel_fields) - 1)
            rip &= rel_fields[k] != field
        idx, do, size = idx[rip], do[rip], size[rip]
        found = len(idx)
        a = dis.addr[idx]
        n = size
        disp = np.zeros(len(idx), np.int64)
        for k in range(4):
            disp |= raw[idx, do + k].astype(np.int64) << (8 * k)
        disp = np.where(disp >= 2**31, disp - 2**32, disp)
        T = a + n.astype(np.uint64) + disp.view(np.uint64)       # wraps like the CPU
        Tn, ok = self.amap.map(T)
        an, _ = self.amap.map(a)
        dn = Tn.astype(np.int64) - (an.astype(np.int64) + n)
        change = dn != disp
        for addr in a[change & ~ok].tolist():
            self.problem("rip-into-padding", [addr], "RIP-relative target in dropped padding")
        fix = np.nonzero(change & ok)[0]
        self.write_fields(an[fix] + do[fix].astype(np.uint64), dn[fix], 4)
        self.stats["rip_relative.unrelocated"] = found
        self.stats["rip_relative.fixed"] = len(fix)

    # -- outputs ---------------------------------------------------------------
    def symtab_bytes(self):
        sec = next(s for s in self.image.sections if s.type == SHT_SYMTAB)
        rows = np.array(self.image.section_bytes(sec)).view(SYM).copy()
        rows["value"] = self.sym_new
        return sec.index, rows.view(np.uint8)

    def new_entry(self):
        e = self.image.entry
        return self.amap.map1(e) if e else e
