/* linepack: re-sequence DWARF line programs (versions 2-5) for a new code layout.
 *
 * Each input sequence is replayed row by row; every row's address range
 * [row, next row) is cut at the boundaries of the address-map segments
 * (old start, old end, new start; sorted, disjoint) and each cut is placed at
 * its new address.  A new output sequence starts whenever the next cut is not
 * contiguous with the previous one in the new layout, so every output sequence
 * covers one contiguous new range and its addresses only increase.  Rows in
 * no segment (dropped padding) are dropped.  Unit headers are copied byte for
 * byte (file and directory tables stay valid); only unit_length changes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t addr;
    uint64_t file, line, column, isa, disc;
    uint8_t is_stmt, basic_block, end_seq, prologue_end, epilogue_begin;
    uint8_t file_set;            /* DW_LNS_set_file seen in this sequence */
} row_t;

typedef struct {
    uint8_t *buf; int64_t len, cap; int overflow;
} out_t;

static void put(out_t *o, uint8_t b) {
    if (o->len < o->cap) o->buf[o->len] = b; else o->overflow = 1;
    o->len++;
}
static void put_uleb(out_t *o, uint64_t v) {
    do { uint8_t b = v & 0x7f; v >>= 7; if (v) b |= 0x80; put(o, b); } while (v);
}
static void put_sleb(out_t *o, int64_t v) {
    for (;;) {
        uint8_t b = v & 0x7f; v >>= 7;
        int done = (v == 0 && !(b & 0x40)) || (v == -1 && (b & 0x40));
        if (!done) b |= 0x80;
        put(o, b);
        if (done) break;
    }
}
static uint64_t get_uleb(const uint8_t *p, const uint8_t *end, const uint8_t **next) {
    uint64_t v = 0; int sh = 0;
    while (p < end) { uint8_t b = *p++; if (sh < 64) v |= (uint64_t)(b & 0x7f) << sh; sh += 7; if (!(b & 0x80)) break; }
    *next = p; return v;
}
static int64_t get_sleb(const uint8_t *p, const uint8_t *end, const uint8_t **next) {
    int64_t v = 0; int sh = 0; uint8_t b = 0;
    while (p < end) { b = *p++; if (sh < 64) v |= (int64_t)(b & 0x7f) << sh; sh += 7; if (!(b & 0x80)) break; }
    if (sh < 64 && (b & 0x40)) v |= -((int64_t)1 << sh);
    *next = p; return v;
}
static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0; for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i); return v;
}

/* Segment k maps old [old_start, old_end) to new [new_start, new_end): linearly
 * from new_start (the bytes past old_end - old_start, if any, are code that
 * belongs to the segment's end: a jmp a block-level layout appended), or, when
 * collapse[k], every address inside to new_start (a re-encoded branch; a
 * removed jmp has new_end == new_start). */
typedef struct {
    const uint64_t *old_start, *old_end, *new_start, *new_end; const uint8_t *collapse; int64_t n;
} segs_t;

/* New start of old [a, b) inside segment k, and its new end. */
static void seg_place(const segs_t *s, int64_t k, uint64_t a, uint64_t b, uint64_t *na, uint64_t *nb) {
    if (s->collapse[k]) {
        *na = s->new_start[k];
        *nb = b == s->old_end[k] ? s->new_end[k] : *na;
    } else {
        *na = s->new_start[k] + (a - s->old_start[k]);
        *nb = b == s->old_end[k] ? s->new_end[k] : *na + (b - a);
    }
}

/* Index of the first segment whose end is above addr (n if none). */
static int64_t seg_after(const segs_t *s, uint64_t addr) {
    int64_t lo = 0, hi = s->n;
    while (lo < hi) { int64_t m = (lo + hi) / 2; if (s->old_end[m] <= addr) lo = m + 1; else hi = m; }
    return lo;
}

typedef struct {
    /* header values */
    int addr_size, min_inst, line_base, line_range, opcode_base, default_is_stmt;
    /* emitter state */
    int open;
    uint64_t cur_end;            /* new address where the open sequence ends */
    row_t st;                    /* registers as the consumer sees them */
    int64_t sequences, rows;
} emit_t;

static void reset_regs(emit_t *e) {
    memset(&e->st, 0, sizeof e->st);
    e->st.file = 1; e->st.line = 1; e->st.is_stmt = (uint8_t)e->default_is_stmt;
}

static void advance_to(out_t *o, emit_t *e, uint64_t addr) {
    if (addr > e->st.addr) {
        put(o, 2); put_uleb(o, (addr - e->st.addr) / (uint64_t)e->min_inst);
        e->st.addr = addr;
    }
}

static void end_seq(out_t *o, emit_t *e) {
    if (!e->open) return;
    advance_to(o, e, e->cur_end);
    put(o, 0); put(o, 1); put(o, 1);
    e->open = 0;
}

static void emit_row(out_t *o, emit_t *e, const row_t *r, uint64_t addr) {
    if (!e->open) {
        reset_regs(e);
        put(o, 0); put_uleb(o, 1 + e->addr_size); put(o, 2);
        for (int i = 0; i < e->addr_size; i++) put(o, (addr >> (8 * i)) & 0xff);
        e->st.addr = addr; e->open = 1; e->sequences++;
    }
    /* Whether the file register was ever set matters to binutils (2.40), which
     * names an unset register by file 0 in DWARF 5 while others use file 1:
     * keep the original's choice. */
    if (r->file != e->st.file || (r->file_set && !e->st.file_set)) {
        put(o, 4); put_uleb(o, r->file); e->st.file = r->file; e->st.file_set = 1;
    }
    if (r->column != e->st.column) { put(o, 5); put_uleb(o, r->column); e->st.column = r->column; }
    if (r->is_stmt != e->st.is_stmt) { put(o, 6); e->st.is_stmt = r->is_stmt; }
    if (r->basic_block && e->opcode_base > 7) put(o, 7);
    if (r->prologue_end && e->opcode_base > 10) put(o, 10);
    if (r->epilogue_begin && e->opcode_base > 11) put(o, 11);
    if (r->isa != e->st.isa && e->opcode_base > 12) { put(o, 12); put_uleb(o, r->isa); e->st.isa = r->isa; }
    if (r->disc) {
        uint8_t tmp[16]; out_t t = {tmp, 0, sizeof tmp, 0};
        put_uleb(&t, r->disc);
        put(o, 0); put_uleb(o, 1 + t.len); put(o, 4);
        for (int64_t i = 0; i < t.len; i++) put(o, tmp[i]);
    }
    uint64_t adv = (addr - e->st.addr) / (uint64_t)e->min_inst;
    int64_t dl = (int64_t)r->line - (int64_t)e->st.line;
    int special = -1;
    if (dl >= e->line_base && dl < e->line_base + e->line_range && adv < 256) {
        uint64_t op = (uint64_t)(dl - e->line_base) + (uint64_t)e->line_range * adv + (uint64_t)e->opcode_base;
        if (op <= 255) special = (int)op;
    }
    if (special >= 0) {
        put(o, (uint8_t)special);
    } else {
        if (dl) { put(o, 3); put_sleb(o, dl); }
        if (adv) { put(o, 2); put_uleb(o, adv); }
        put(o, 1);
    }
    e->st.addr = addr; e->st.line = r->line;
    e->rows++;
}

/* Place one old sequence (rows[0..n-1], the last being end_sequence). */
static void place_sequence(out_t *o, emit_t *e, const segs_t *s, const row_t *rows, int64_t n,
                           int64_t *dropped) {
    for (int64_t i = 0; i + 1 < n; i++) {
        uint64_t lo = rows[i].addr, hi = rows[i + 1].addr;
        if (hi <= lo) {                         /* a row of no length: place the point */
            int64_t k = seg_after(s, lo);
            uint64_t na, nb;
            if (k < s->n && s->old_start[k] <= lo) seg_place(s, k, lo, lo, &na, &nb);
            else if (k > 0 && s->old_end[k - 1] == lo) seg_place(s, k - 1, lo, lo, &nb, &na);
            else { (*dropped)++; continue; }
            if (e->open && na != e->cur_end) end_seq(o, e);
            if (!e->open) e->cur_end = na;
            emit_row(o, e, &rows[i], na);
            continue;
        }
        int placed = 0;
        for (int64_t k = seg_after(s, lo); k < s->n && s->old_start[k] < hi; k++) {
            uint64_t a = lo > s->old_start[k] ? lo : s->old_start[k];
            uint64_t b = hi < s->old_end[k] ? hi : s->old_end[k];
            uint64_t na, nb;
            seg_place(s, k, a, b, &na, &nb);
            if (nb <= na) continue;             /* nothing of it in the new layout */
            if (e->open && na == e->cur_end) {
                if (!placed) emit_row(o, e, &rows[i], na);
            } else {
                end_seq(o, e);
                emit_row(o, e, &rows[i], na);
            }
            e->cur_end = nb;
            placed = 1;
        }
        if (!placed) (*dropped)++;
    }
    end_seq(o, e);
}

/* Row dump for checks: every row of every sequence, with its unit's index. */
typedef struct {
    uint64_t *addr; uint32_t *unit, *file, *line, *column; uint8_t *flags; int64_t n, cap;
} rows_sink_t;

static void sink_sequence(rows_sink_t *k, int64_t unit, const row_t *rows, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (k->n < k->cap) {
            k->addr[k->n] = rows[i].addr; k->unit[k->n] = (uint32_t)unit;
            k->file[k->n] = (uint32_t)rows[i].file; k->line[k->n] = (uint32_t)rows[i].line;
            k->column[k->n] = (uint32_t)rows[i].column;
            k->flags[k->n] = (uint8_t)(rows[i].end_seq | (rows[i].is_stmt << 1));
        }
        k->n++;
    }
}

static int64_t run_units(const uint8_t *in, int64_t in_len, const segs_t *sp, int default_addr_size,
                         out_t *op, int64_t *unit_old, int64_t *unit_new, int64_t max_units,
                         int64_t *stats, rows_sink_t *sink);

/* Returns the output length (may exceed out_cap: call again with a bigger
 * buffer), or -(offset+1) of the first unit that cannot be parsed.
 * unit_old/unit_new: offsets of each unit in the input/output (max_units).
 * stats: [units, sequences in, sequences out, rows out, rows dropped]. */
int64_t lp_relines(const uint8_t *in, int64_t in_len,
                   const uint64_t *old_start, const uint64_t *old_end, const uint64_t *new_start,
                   const uint64_t *new_end, const uint8_t *collapse,
                   int64_t nseg, int default_addr_size,
                   uint8_t *out_buf, int64_t out_cap,
                   int64_t *unit_old, int64_t *unit_new, int64_t max_units, int64_t *stats) {
    segs_t s = {old_start, old_end, new_start, new_end, collapse, nseg};
    out_t o = {out_buf, 0, out_cap, 0};
    return run_units(in, in_len, &s, default_addr_size, &o, unit_old, unit_new, max_units, stats, NULL);
}

/* Every row of every sequence (flags: 1 end_sequence, 2 is_stmt); returns the
 * row count (may exceed cap: call again), or -(offset+1) on a bad unit. */
int64_t lp_rows(const uint8_t *in, int64_t in_len, int default_addr_size,
                uint64_t *addr, uint32_t *unit, uint32_t *file, uint32_t *line, uint32_t *column,
                uint8_t *flags, int64_t cap) {
    rows_sink_t k = {addr, unit, file, line, column, flags, 0, cap};
    segs_t s = {0, 0, 0, 0, 0, 0};
    uint8_t dummy[1]; out_t o = {dummy, 0, 0, 0};
    int64_t stats[5];
    int64_t r = run_units(in, in_len, &s, default_addr_size, &o, NULL, NULL, 0, stats, &k);
    return r < 0 ? r : k.n;
}

static int64_t run_units(const uint8_t *in, int64_t in_len, const segs_t *sp, int default_addr_size,
                         out_t *op, int64_t *unit_old, int64_t *unit_new, int64_t max_units,
                         int64_t *stats, rows_sink_t *sink) {
    const segs_t s = *sp;
    out_t o = *op;
    uint8_t *out_buf = o.buf;
    int64_t pos = 0, nunits = 0, seq_in = 0, dropped = 0;
    emit_t e; memset(&e, 0, sizeof e);
    int64_t rows_cap = 4096;
    row_t *rows = malloc(sizeof(row_t) * rows_cap);
    if (!rows) return -1;
    while (pos + 4 <= in_len) {
        const uint8_t *u = in + pos;
        uint64_t ulen = get_le(u, 4);
        int off64 = 0, lenfield = 4;
        if (ulen == 0xffffffffu) { if (pos + 12 > in_len) break; ulen = get_le(u + 4, 8); off64 = 1; lenfield = 12; }
        if (ulen < 2 || (uint64_t)(in_len - pos - lenfield) < ulen) { free(rows); return -(pos + 1); }
        const uint8_t *uend = u + lenfield + ulen;
        const uint8_t *p = u + lenfield;
        int version = (int)get_le(p, 2); p += 2;
        int addr_size = default_addr_size;
        if (version < 2 || version > 5) { free(rows); return -(pos + 1); }
        if (version >= 5) { addr_size = p[0]; p += 2; }
        uint64_t hlen = get_le(p, off64 ? 8 : 4); p += off64 ? 8 : 4;
        const uint8_t *prog = p + hlen;
        if (prog > uend) { free(rows); return -(pos + 1); }
        e.min_inst = p[0] ? p[0] : 1; p++;
        if (version >= 4) p++;                       /* maximum_operations_per_instruction */
        e.default_is_stmt = p[0] ? 1 : 0; p++;
        e.line_base = (int8_t)p[0]; p++;
        e.line_range = p[0] ? p[0] : 1; p++;
        e.opcode_base = p[0]; p++;
        const uint8_t *std_len = p;
        e.addr_size = addr_size;
        if (nunits < max_units) { unit_old[nunits] = pos; unit_new[nunits] = o.len; }
        nunits++;
        int64_t out_unit = o.len;
        /* copy the header, unit_length patched at the end */
        for (const uint8_t *q = u; q < prog; q++) put(&o, *q);
        /* run the state machine */
        row_t r; memset(&r, 0, sizeof r);
        r.file = 1; r.line = 1; r.is_stmt = (uint8_t)e.default_is_stmt;
        int64_t nrows = 0;
        const uint8_t *q = prog;
        while (q < uend) {
            uint8_t op = *q++;
            int emit = 0;
            if (op >= e.opcode_base) {
                int adj = op - e.opcode_base;
                r.addr += (uint64_t)(adj / e.line_range) * e.min_inst;
                r.line += (int64_t)(e.line_base + adj % e.line_range);
                emit = 1;
            } else if (op == 0) {
                uint64_t len = get_uleb(q, uend, &q);
                const uint8_t *xend = q + len;
                if (len == 0 || xend > uend) break;
                uint8_t sub = *q++;
                if (sub == 1) { r.end_seq = 1; emit = 1; }
                else if (sub == 2) r.addr = get_le(q, (int)(len - 1 > 8 ? 8 : len - 1));
                else if (sub == 4) r.disc = get_uleb(q, xend, &q);
                q = xend;
            } else switch (op) {
                case 1: emit = 1; break;
                case 2: r.addr += get_uleb(q, uend, &q) * e.min_inst; break;
                case 3: r.line += get_sleb(q, uend, &q); break;
                case 4: r.file = get_uleb(q, uend, &q); r.file_set = 1; break;
                case 5: r.column = get_uleb(q, uend, &q); break;
                case 6: r.is_stmt = !r.is_stmt; break;
                case 7: r.basic_block = 1; break;
                case 8: r.addr += (uint64_t)((255 - e.opcode_base) / e.line_range) * e.min_inst; break;
                case 9: r.addr += get_le(q, 2); q += 2; break;
                case 10: r.prologue_end = 1; break;
                case 11: r.epilogue_begin = 1; break;
                case 12: r.isa = get_uleb(q, uend, &q); break;
                default:
                    for (int a = 0; a < std_len[op - 1]; a++) get_uleb(q, uend, &q);
            }
            if (emit) {
                if (nrows == rows_cap) {
                    rows_cap *= 2;
                    row_t *nr = realloc(rows, sizeof(row_t) * rows_cap);
                    if (!nr) { free(rows); return -1; }
                    rows = nr;
                }
                rows[nrows++] = r;
                r.basic_block = r.prologue_end = r.epilogue_begin = 0; r.disc = 0;
                if (r.end_seq) {
                    seq_in++;
                    if (sink) sink_sequence(sink, nunits - 1, rows, nrows);
                    else place_sequence(&o, &e, &s, rows, nrows, &dropped);
                    nrows = 0;
                    memset(&r, 0, sizeof r);
                    r.file = 1; r.line = 1; r.is_stmt = (uint8_t)e.default_is_stmt;
                }
            }
        }
        /* a sequence left without end_sequence is dropped, as consumers do */
        int64_t body = o.len - out_unit - lenfield;
        if (!o.overflow && !sink) {
            if (off64) { for (int i = 0; i < 8; i++) out_buf[out_unit + 4 + i] = (body >> (8 * i)) & 0xff; }
            else {
                if (body > 0xfffffff0LL) { free(rows); return -(pos + 1); }
                for (int i = 0; i < 4; i++) out_buf[out_unit + i] = (body >> (8 * i)) & 0xff;
            }
        }
        pos = uend - in;
    }
    free(rows);
    stats[0] = nunits; stats[1] = seq_in; stats[2] = e.sequences; stats[3] = e.rows; stats[4] = dropped;
    return o.len;
}
