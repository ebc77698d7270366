/* linepack: every address field of a linked image's DWARF, found by parsing
 * it (for images whose link relocations, .rela.debug_*, are gone: every
 * kernel since 6.5). The fields are those the link relocated with
 * R_X86_64_64 (8-byte absolute addresses) and the 4-byte section offsets
 * into the list sections (R_X86_64_32); fields.py turns them into the
 * arrays the rewriter reads from relocations.
 *
 * - lp_info_fields: every DIE of every unit: DW_FORM_addr values, DW_OP_addr
 *   operands of DWARF expressions (exprloc; block forms of location
 *   attributes before DWARF 4), and section-offset attributes (list
 *   references, with their attribute);
 * - lp_list_fields: range and location lists reached from those references:
 *   DWARF 5 base_address / start_end / start_length operands (offset pairs are
 *   relative to a base: no field), DWARF 2-4 entries read under a base of 0
 *   (absolute) and base-selection addresses, DW_OP_addr in location
 *   expressions;
 * - lp_line_fields: DW_LNE_set_address operands of every line program;
 * - lp_aranges_fields: the start of every address range tuple;
 * - lp_frame_fields: FDE initial locations, DW_CFA_set_loc operands and
 *   DW_OP_addr in CFA expressions.
 *
 * Output arrays have room for ``cap`` fields; the count returned may exceed
 * it (call again with more room). Malformed input gives a negative return or
 * a per-item status, never a read out of bounds.
 */
#include "read.h"

typedef struct { int64_t *pos; uint64_t *val; int64_t n, cap; } fields_t;

static void field(fields_t *f, const sec_t *s, int64_t pos, int size) {
    uint64_t v = 0;
    rd_le(s, pos, size, &v);
    if (f->n < f->cap) { f->pos[f->n] = pos; f->val[f->n] = v; }
    f->n++;
}

/* ---------------------------------------------------------- expressions */

/* DW_OP_addr operands of the expression [p, end) into f. ``osz``: size of a
 * reference to .debug_info (DW_OP_call_ref, implicit_pointer). Returns 0, or
 * -1 when an operation is unknown or truncated (the rest cannot be read). */
static int expr_fields(const sec_t *s, int64_t p, int64_t end, int asz, int osz, fields_t *f,
                       int depth) {
    uint64_t u;
    int64_t sv;
    if (end > s->n || depth > 4) return -1;
    const sec_t e = {s->b, end};       /* reads stop at the expression's end */
    while (p < end) {
        uint8_t op = s->b[p++];
        int64_t n = 0;                  /* fixed operand bytes */
        if (op >= 0x30 && op <= 0x6f) continue;                    /* lit, reg */
        if (op >= 0x70 && op <= 0x8f) { if (rd_sleb(&e, &p, &sv)) return -1; continue; }   /* breg */
        switch (op) {
        case 0x03:                                                  /* addr */
            if (p + asz > end) return -1;
            if (asz == 8) field(f, s, p, 8);
            n = asz; break;
        case 0x06: case 0x12: case 0x13: case 0x14: case 0x16: case 0x17: case 0x18: case 0x19:
        case 0x1a: case 0x1b: case 0x1c: case 0x1d: case 0x1e: case 0x1f: case 0x20: case 0x21:
        case 0x22: case 0x24: case 0x25: case 0x26: case 0x27: case 0x29: case 0x2a: case 0x2b:
        case 0x2c: case 0x2d: case 0x2e: case 0x96: case 0x97: case 0x9b: case 0x9c: case 0x9f:
        case 0xe0: case 0xf0:
            break;                                                  /* no operand */
        case 0x08: case 0x09: case 0x15: case 0x94: case 0x95: n = 1; break;
        case 0x0a: case 0x0b: case 0x28: case 0x2f: case 0x98: n = 2; break;
        case 0x0c: case 0x0d: case 0x99: case 0xfa: n = 4; break;
        case 0x0e: case 0x0f: n = 8; break;
        case 0x9a: case 0xfd: n = osz; break;                       /* call_ref, GNU_variable_value */
        case 0x10: case 0x23: case 0x90: case 0x93: case 0xa1: case 0xa2: case 0xa8: case 0xa9:
        case 0xf7: case 0xf9: case 0xfb: case 0xfc:
            if (rd_uleb(&e, &p, &u)) return -1;
            break;
        case 0x11: case 0x91: if (rd_sleb(&e, &p, &sv)) return -1; break;
        case 0x92: case 0x9d: case 0xa5: case 0xf5:
            if (rd_uleb(&e, &p, &u)) return -1;
            if (op == 0x92 ? rd_sleb(&e, &p, &sv) : rd_uleb(&e, &p, &u)) return -1;
            break;
        case 0x9e:                                                  /* implicit_value */
            if (rd_uleb(&e, &p, &u) || u > (uint64_t)(end - p)) return -1;
            n = (int64_t)u; break;
        case 0xa0: case 0xf2:                                       /* implicit_pointer */
            p += osz;
            if (p > end || rd_sleb(&e, &p, &sv)) return -1;
            break;
        case 0xa3: case 0xf3:                                       /* entry_value: a sub-expression */
            if (rd_uleb(&e, &p, &u) || u > (uint64_t)(end - p)) return -1;
            if (expr_fields(s, p, p + (int64_t)u, asz, osz, f, depth + 1)) return -1;
            n = (int64_t)u; break;
        case 0xa4: case 0xf4:                                       /* const_type: type, size, bytes */
            if (rd_uleb(&e, &p, &u) || p >= end) return -1;
            n = 1 + s->b[p]; break;
        case 0xa6: case 0xa7: case 0xf6:                            /* deref_type: size, type */
            p++;
            if (p > end || rd_uleb(&e, &p, &u)) return -1;
            break;
        default:
            return -1;
        }
        if (p + n > end) return -1;
        p += n;
    }
    return 0;
}

/* ------------------------------------------------------------------ DIEs */

#define DW_FORM_exprloc 0x18
#define DW_FORM_sec_offset 0x17

/* Attributes whose value is a DWARF expression (a location description) when
 * given in a block form before DWARF 4 (from DWARF 4 on: DW_FORM_exprloc). */
static int location_attr(uint64_t at) {
    switch (at) {
    case 0x02: case 0x19: case 0x2a: case 0x2e: case 0x38: case 0x40: case 0x48: case 0x4a:
    case 0x4d: case 0x50: case 0x2111: case 0x2113:
        return 1;
    }
    return 0;
}

/* Every DIE of every unit i (DIEs from die[i] to end[i]): address fields into
 * ``addr`` (8-byte DW_FORM_addr values, DW_OP_addr operands), section-offset
 * attributes (DW_FORM_sec_offset; data4/data8 of a location or ranges
 * attribute before DWARF 4) into ref_pos/ref_val with ref_attr (the
 * attribute), ref_unit (i) and ref_size (4 or 8), up to ref_cap; unit_base[i]:
 * the unit DIE's DW_FORM_addr low pc (0 without). counts: [0] address fields,
 * [1] references, [2] unreadable expressions, [3] index forms (addrx,
 * rnglistx, loclistx: their values are not in .debug_info). Returns 0, or -1
 * truncated, -2 unknown form, -3 unknown abbreviation code, -4 bad
 * abbreviation table (err_pos: where). */
int64_t lp_info_fields(const uint8_t *info, int64_t info_len, const uint8_t *abbrev,
                       int64_t abbrev_len, int64_t nunits, const int64_t *die, const int64_t *end,
                       const int64_t *version, const int64_t *asz, const int64_t *osz,
                       const int64_t *abbrev_off,
                       int64_t *addr_pos, uint64_t *addr_val, int64_t addr_cap,
                       int64_t *ref_pos, uint64_t *ref_val, int32_t *ref_attr, int32_t *ref_unit,
                       uint8_t *ref_size, int64_t ref_cap,
                       uint64_t *unit_base, int64_t *counts, int64_t *err_pos) {
    sec_t si = {info, info_len}, sa = {abbrev, abbrev_len};
    fields_t fa = {addr_pos, addr_val, 0, addr_cap};
    int64_t nref = 0, bad_expr = 0, indexed = 0;
    atab_t t;
    memset(&t, 0, sizeof t);
    int64_t cur_tab = -1, rc = 0;
    for (int64_t i = 0; i < nunits; i++) {
        unit_base[i] = 0;
        if (abbrev_off[i] != cur_tab) {
            atab_free(&t);
            if (atab_parse(&t, &sa, abbrev_off[i])) { *err_pos = abbrev_off[i]; rc = -4; goto done; }
            cur_tab = abbrev_off[i];
        }
        int a_sz = (int)asz[i], o_sz = (int)osz[i], ver = (int)version[i];
        int64_t p = die[i], e = end[i] < info_len ? end[i] : info_len;
        int first = 1;
        while (p < e) {
            int64_t o = p;
            uint64_t code;
            if (rd_uleb(&si, &p, &code)) { *err_pos = o; rc = -1; goto done; }
            if (code == 0) { first = 0; continue; }
            const abbrev_t *a = atab_get(&t, code);
            if (!a) { *err_pos = o; rc = -3; goto done; }
            for (int64_t k = 0; k < a->n; k++) {
                uint64_t f = t.sp[a->first + k].form, at = t.sp[a->first + k].attr;
                if (f == DW_FORM_indirect && rd_uleb(&si, &p, &f)) { *err_pos = p; rc = -1; goto done; }
                int64_t q = p;
                int r = skip_form(&si, &p, f, a_sz, o_sz, ver);
                if (r) { *err_pos = q; rc = r == -2 ? -2 : -1; goto done; }
                int is_ref = f == DW_FORM_sec_offset ||
                    (ver < 4 && (f == 0x06 || f == 0x07) && (location_attr(at) || at == 0x55 || at == 0x10));
                if (f == DW_FORM_addr) {
                    uint64_t v = 0;
                    rd_le(&si, q, a_sz, &v);
                    /* a unit's low pc of 0 is the base of its range lists (the
                     * compiler's literal 0, not an address the link relocated) */
                    if (a_sz == 8 && !(first && at == 0x11 && v == 0)) field(&fa, &si, q, 8);
                    if (first && at == 0x11) unit_base[i] = v;
                } else if (f == DW_FORM_exprloc || (ver < 4 && location_attr(at) &&
                           (f == 0x09 || f == 0x0a || f == 0x03 || f == 0x04))) {
                    uint64_t len;
                    int64_t x = q;
                    if (f == 0x0a) { rd_le(&si, x, 1, &len); x += 1; }
                    else if (f == 0x03) { rd_le(&si, x, 2, &len); x += 2; }
                    else if (f == 0x04) { rd_le(&si, x, 4, &len); x += 4; }
                    else rd_uleb(&si, &x, &len);
                    if (expr_fields(&si, x, p, a_sz, ver <= 2 ? a_sz : o_sz, &fa, 0)) bad_expr++;
                } else if (is_ref) {
                    if (nref < ref_cap) {
                        ref_pos[nref] = q; rd_le(&si, q, (int)(p - q), &ref_val[nref]);
                        ref_attr[nref] = (int32_t)at; ref_unit[nref] = (int32_t)i;
                        ref_size[nref] = (uint8_t)(p - q);
                    }
                    nref++;
                } else if ((f >= 0x29 && f <= 0x2c) || f == 0x1b || f == 0x22 || f == 0x23 ||
                           f == 0x1f01) {
                    indexed++;
                }
            }
            first = 0;
        }
    }
done:
    atab_free(&t);
    counts[0] = fa.n; counts[1] = nref; counts[2] = bad_expr; counts[3] = indexed;
    return rc;
}

/* ----------------------------------------------------------------- lists */

/* Fields of the lists at off[i] (each read once by the caller) of a list
 * section of ``kind``: 0 .debug_rnglists, 1 .debug_ranges, 2 .debug_loclists,
 * 3 .debug_loc; base[i]: the unit's base address, asz[i]/osz[i] its sizes.
 * status[i]: 0, 1 unreadable (its fields up to there are kept), 2 an entry
 * through .debug_addr (an index: the address is not in this section).
 * Returns the field count (may exceed cap). */
int64_t lp_list_fields(const uint8_t *sec, int64_t sec_len, int kind, int64_t n,
                       const int64_t *off, const uint64_t *base, const int64_t *asz,
                       const int64_t *osz, int64_t *pos, uint64_t *val, int64_t cap,
                       uint8_t *status) {
    sec_t s = {sec, sec_len};
    fields_t f = {pos, val, 0, cap};
    int loc = kind >= 2, v5 = kind == 0 || kind == 2;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = off[i];
        int a = (int)asz[i], bad = 0;
        uint64_t b = base[i], x, y, len;
        status[i] = 0;
        if (!v5) {
            /* DWARF 2-4: (begin, end) pairs; absolute (relocated) while the base
             * in effect is 0, else offsets from it; (~0, addr) selects a base */
            uint64_t ones = a >= 8 ? ~(uint64_t)0 : (((uint64_t)1 << (8 * a)) - 1);
            for (;;) {
                if (rd_le(&s, p, a, &x) || rd_le(&s, p + a, a, &y)) { bad = 1; break; }
                if (x == 0 && y == 0) break;
                if (x == ones) {
                    if (a == 8) field(&f, &s, p + a, 8);
                    b = y; p += 2 * a; continue;
                }
                if (b == 0 && a == 8) { field(&f, &s, p, 8); field(&f, &s, p + 8, 8); }
                p += 2 * a;
                if (loc) {
                    if (rd_le(&s, p, 2, &len) || p + 2 + (int64_t)len > s.n) { bad = 1; break; }
                    if (expr_fields(&s, p + 2, p + 2 + (int64_t)len, a, (int)osz[i], &f, 0)) bad = 1;
                    p += 2 + (int64_t)len;
                    if (bad) break;
                }
            }
            status[i] = (uint8_t)bad;
            continue;
        }
        for (;;) {
            uint64_t k;
            int expr = loc;
            if (rd_le(&s, p, 1, &k)) { bad = 1; break; }
            p++;
            if (k == 0) break;
            if (!loc) {
                switch (k) {
                case 1: if (rd_uleb(&s, &p, &x)) bad = 1; status[i] = 2; break;
                case 2: case 3: if (rd_uleb(&s, &p, &x) || rd_uleb(&s, &p, &y)) bad = 1; status[i] = 2; break;
                case 4: if (rd_uleb(&s, &p, &x) || rd_uleb(&s, &p, &y)) bad = 1; break;
                case 5: if (p + a > s.n) { bad = 1; break; } field(&f, &s, p, a); p += a; break;
                case 6:
                    if (p + 2 * a > s.n) { bad = 1; break; }
                    field(&f, &s, p, a); field(&f, &s, p + a, a); p += 2 * a; break;
                case 7:
                    if (p + a > s.n) { bad = 1; break; }
                    field(&f, &s, p, a); p += a;
                    if (rd_uleb(&s, &p, &x)) bad = 1;
                    break;
                default: bad = 1;
                }
                if (bad) break;
                continue;
            }
            switch (k) {
            case 1: if (rd_uleb(&s, &p, &x)) bad = 1; status[i] = 2; expr = 0; break;
            case 2: case 3:
                if (rd_uleb(&s, &p, &x) || rd_uleb(&s, &p, &y)) bad = 1;
                status[i] = 2; break;
            case 4: if (rd_uleb(&s, &p, &x) || rd_uleb(&s, &p, &y)) bad = 1; break;
            case 5: break;                                          /* default location */
            case 6: if (p + a > s.n) { bad = 1; break; } field(&f, &s, p, a); p += a; expr = 0; break;
            case 7:
                if (p + 2 * a > s.n) { bad = 1; break; }
                field(&f, &s, p, a); field(&f, &s, p + a, a); p += 2 * a; break;
            case 8:
                if (p + a > s.n) { bad = 1; break; }
                field(&f, &s, p, a); p += a;
                if (rd_uleb(&s, &p, &x)) bad = 1;
                break;
            case 9:                                                 /* GNU view pair */
                if (rd_uleb(&s, &p, &x) || rd_uleb(&s, &p, &y)) bad = 1;
                expr = 0; break;
            default: bad = 1;
            }
            if (bad) break;
            if (expr) {
                if (rd_uleb(&s, &p, &len) || len > (uint64_t)(s.n - p)) { bad = 1; break; }
                if (expr_fields(&s, p, p + (int64_t)len, a, (int)osz[i], &f, 0)) { bad = 1; break; }
                p += (int64_t)len;
            }
        }
        (void)b;
        if (bad) status[i] = 1;
    }
    return f.n;
}

/* ------------------------------------------------------------ line programs */

/* DW_LNE_set_address operands (8 bytes) of every line program; counts[0]:
 * units read. Returns the field count (may exceed cap), or -(offset + 1) of a
 * unit whose header cannot be read. */
int64_t lp_line_fields(const uint8_t *sec, int64_t sec_len, int64_t *pos, uint64_t *val,
                       int64_t cap, int64_t *counts) {
    sec_t s = {sec, sec_len};
    fields_t f = {pos, val, 0, cap};
    int64_t u = 0, units = 0;
    while (u + 4 <= sec_len) {
        uint64_t len, hlen, x;
        int64_t p = u, lf = 4;
        rd_le(&s, p, 4, &len);
        if (len == 0xffffffffu) { if (rd_le(&s, p + 4, 8, &len)) return -(u + 1); lf = 12; }
        int64_t uend = u + lf + (int64_t)len;
        if (len < 2 || uend > sec_len) return -(u + 1);
        p += lf;
        rd_le(&s, p, 2, &x);
        int version = (int)x;
        p += 2;
        if (version < 2 || version > 5) return -(u + 1);
        if (version >= 5) p += 2;                     /* address_size, seg_sel_size */
        if (rd_le(&s, p, lf == 12 ? 8 : 4, &hlen)) return -(u + 1);
        p += lf == 12 ? 8 : 4;
        int64_t prog = p + (int64_t)hlen;
        if (prog > uend || p + 5 + (version >= 4) > uend) return -(u + 1);
        p += version >= 4 ? 4 : 3;                     /* min_inst, [max_ops], default_is_stmt, line_base */
        p++;                                          /* line_range */
        int opcode_base = s.b[p++];
        const uint8_t *std_len = s.b + p;
        if (p + opcode_base - 1 > uend) return -(u + 1);
        const sec_t us = {s.b, uend};
        p = prog;
        while (p < uend) {
            uint8_t op = s.b[p++];
            if (op >= opcode_base) continue;
            if (op == 0) {
                if (rd_uleb(&us, &p, &x)) break;
                int64_t xend = p + (int64_t)x;
                if (x == 0 || xend > uend) break;
                if (s.b[p] == 2 && x == 9) field(&f, &s, p + 1, 8);
                p = xend;
                continue;
            }
            if (op == 9) { p += 2; continue; }                 /* fixed_advance_pc */
            int nargs = op == 1 || op == 6 || op == 7 || op == 8 || op == 10 || op == 11 ? 0 :
                        (op <= 5 || op == 12) ? 1 : std_len[op - 1];
            for (int k = 0; k < nargs; k++) if (rd_uleb(&us, &p, &x)) { p = uend; break; }
        }
        units++;
        u = uend;
    }
    counts[0] = units;
    return f.n;
}

/* ------------------------------------------------------------------ aranges */

/* The start of every (start, length) tuple of every 8-byte-address set, up to
 * the terminating (0, 0). Returns the field count (may exceed cap). */
int64_t lp_aranges_fields(const uint8_t *sec, int64_t sec_len, int64_t *pos, uint64_t *val,
                          int64_t cap) {
    sec_t s = {sec, sec_len};
    fields_t f = {pos, val, 0, cap};
    int64_t u = 0;
    while (u + 4 <= sec_len) {
        uint64_t len, x, y;
        int64_t lf = 4, osz = 4;
        rd_le(&s, u, 4, &len);
        if (len == 0xffffffffu) { if (rd_le(&s, u + 4, 8, &len)) break; lf = 12; osz = 8; }
        int64_t uend = u + lf + (int64_t)len;
        if (uend > sec_len) uend = sec_len;
        int64_t p = u + lf + 2 + osz;                 /* version, debug_info_offset */
        if (p + 2 > uend) break;
        int asz = s.b[p], ssz = s.b[p + 1];
        p += 2;
        int64_t tup = 2 * asz + ssz;
        if (tup && (p - u) % tup) p += tup - (p - u) % tup;
        while (asz == 8 && ssz == 0 && p + 16 <= uend) {
            rd_le(&s, p, 8, &x); rd_le(&s, p + 8, 8, &y);
            if (x == 0 && y == 0) break;
            field(&f, &s, p, 8);
            p += 16;
        }
        u = uend;
    }
    return f.n;
}

/* ------------------------------------------------------------ .debug_frame */

/* FDE initial locations (the CIE's address size; 8 before DWARF 4 CIEs),
 * DW_CFA_set_loc operands and DW_OP_addr in CFA expressions. counts[0]: FDEs,
 * counts[1]: entries whose instructions could not be read. Returns the field
 * count (may exceed cap). */
int64_t lp_frame_fields(const uint8_t *sec, int64_t sec_len, int64_t *pos, uint64_t *val,
                        int64_t cap, int64_t *counts) {
    sec_t s = {sec, sec_len};
    fields_t f = {pos, val, 0, cap};
    int64_t u = 0, fdes = 0, bad = 0;
    while (u + 4 <= sec_len) {
        uint64_t len, id, x;
        int64_t lf = 4, osz = 4;
        rd_le(&s, u, 4, &len);
        if (len == 0) break;
        if (len == 0xffffffffu) { if (rd_le(&s, u + 4, 8, &len)) break; lf = 12; osz = 8; }
        int64_t end = u + lf + (int64_t)len;
        if (end > sec_len) break;
        int64_t p = u + lf;
        rd_le(&s, p, (int)osz, &id);
        p += osz;
        uint64_t cie_id = osz == 8 ? ~(uint64_t)0 : 0xffffffffu;
        const sec_t es = {s.b, end};
        if (id == cie_id) { u = end; continue; }
        /* its CIE: address size (v4) and whether it has augmentation data */
        int asz = 8, aug_z = 0;
        int64_t c = (int64_t)id, cl = 4;
        uint64_t clen;
        if (!rd_le(&s, c, 4, &clen)) {
            if (clen == 0xffffffffu) cl = 12;
            int64_t q = c + cl + osz;
            if (q < sec_len) {
                int ver = s.b[q++];
                const uint8_t *z = memchr(s.b + q, 0, (size_t)(sec_len - q));
                if (z) {
                    aug_z = s.b[q] == 'z';
                    q = z - s.b + 1;
                    if (ver >= 4 && q < sec_len) asz = s.b[q];
                }
            }
        }
        fdes++;
        if (p + 2 * asz > end) { bad++; u = end; continue; }
        field(&f, &s, p, asz);
        p += 2 * asz;
        if (aug_z) { if (rd_uleb(&es, &p, &x) || x > (uint64_t)(end - p)) { bad++; u = end; continue; } p += (int64_t)x; }
        int broken = 0;
        while (p < end && !broken) {
            uint8_t op = s.b[p++];
            int64_t sv;
            if (op & 0xc0) {                      /* advance_loc, offset, restore */
                if ((op & 0xc0) == 0x80 && rd_uleb(&es, &p, &x)) broken = 1;
                continue;
            }
            switch (op) {
            case 0x00: case 0x0a: case 0x0b: break;
            case 0x01: if (p + asz > end) { broken = 1; break; } field(&f, &s, p, asz); p += asz; break;
            case 0x02: p += 1; break;
            case 0x03: p += 2; break;
            case 0x04: p += 4; break;
            case 0x1d: p += 8; break;
            case 0x06: case 0x07: case 0x08: case 0x0d: case 0x0e: case 0x2e:
                if (rd_uleb(&es, &p, &x)) broken = 1;
                break;
            case 0x05: case 0x09: case 0x0c: case 0x14: case 0x2f:
                if (rd_uleb(&es, &p, &x) || rd_uleb(&es, &p, &x)) broken = 1;
                break;
            case 0x11: case 0x12: case 0x15:
                if (rd_uleb(&es, &p, &x) || rd_sleb(&es, &p, &sv)) broken = 1;
                break;
            case 0x13: if (rd_sleb(&es, &p, &sv)) broken = 1; break;
            case 0x0f: case 0x10: case 0x16:
                if (op != 0x0f && rd_uleb(&es, &p, &x)) { broken = 1; break; }
                if (rd_uleb(&es, &p, &x) || x > (uint64_t)(end - p)) { broken = 1; break; }
                if (expr_fields(&s, p, p + (int64_t)x, asz, (int)osz, &f, 0)) broken = 1;
                p += (int64_t)x;
                break;
            default: broken = 1;
            }
        }
        bad += broken || p > end;
        u = end;
    }
    counts[0] = fdes; counts[1] = bad;
    return f.n;
}
