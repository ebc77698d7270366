/* linepack: the per-DIE and per-list-entry work of the DWARF rewrite and of
 * verify's debug-info check, in bulk (numpy arrays in and out through ctypes).
 *
 * - lp_dies: walk every DIE of one unit (abbreviation table parsed here) and
 *   report, per DIE, its offset, code, tag and, for a few requested
 *   attributes, the form, value position, value end and value (the value's
 *   bytes, little-endian, at most 8);
 * - lp_seg_ranges: old [lo, hi) ranges translated through the address-map
 *   segments (rewrite.py's Segments), contiguous runs merged, optionally
 *   sorted and merged as merge_ranges does, with a flag saying whether the
 *   range moved as one linear block;
 * - lp_encode_ranges: range lists appended (DWARF 5 DW_RLE_start_length, or a
 *   DWARF 4 .debug_ranges list with a base-address selection of 0);
 * - lp_relist: range and location lists of units whose base moved, read,
 *   translated and re-encoded with absolute entries (with GNU location views);
 * - lp_read_lists: DW_AT_ranges lists read into absolute ranges.
 *
 * Malformed input (a position outside its section, an unknown form or list
 * entry kind, an unknown abbreviation) is reported through a negative return
 * or a per-item status, never by reading out of bounds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "read.h"

typedef struct { uint8_t *b; int64_t n, cap; } buf_t;

static int bput(buf_t *o, const void *src, int64_t n) {
    if (o->n + n > o->cap) {
        int64_t c = o->cap ? o->cap : 4096;
        while (c < o->n + n) c *= 2;
        uint8_t *nb = realloc(o->b, (size_t)c);
        if (!nb) return -1;
        o->b = nb; o->cap = c;
    }
    memcpy(o->b + o->n, src, (size_t)n); o->n += n; return 0;
}
static int bput1(buf_t *o, uint8_t x) { return bput(o, &x, 1); }
static int bput_le(buf_t *o, uint64_t v, int n) {
    uint8_t t[8]; for (int i = 0; i < n; i++) t[i] = (v >> (8 * i)) & 0xff; return bput(o, t, n);
}
static int bput_uleb(buf_t *o, uint64_t v) {
    uint8_t t[10]; int n = 0;
    do { uint8_t c = v & 0x7f; v >>= 7; if (v) c |= 0x80; t[n++] = c; } while (v);
    return bput(o, t, n);
}

/* The value of an attribute whose bytes are [q, p) in ``form``: LEB128 forms
 * decoded (DW_FORM_udata, sdata as two's complement, the index and ref_udata
 * forms; GNU as gives a unit's high pc as udata, 2 bytes from 128 on), any
 * other form the little-endian value of its first <= 8 bytes. */
static uint64_t form_value(const sec_t *s, int64_t q, int64_t p, uint64_t form) {
    uint64_t v = 0;
    int64_t r = q;
    switch (form) {
    case 0x0d: { int64_t sv; if (rd_sleb(s, &r, &sv)) return 0; return (uint64_t)sv; }
    case 0x0f: case 0x15: case 0x1a: case 0x1b: case 0x22: case 0x23: case 0x1f01: case 0x1f02:
        if (rd_uleb(s, &r, &v)) return 0;
        return v;
    default:
        rd_le(s, q, p - q > 8 ? 8 : (int)(p - q), &v);
        return v;
    }
}

/* Every DIE of one unit (DIEs from ``die`` to ``end``). Returns the DIE count
 * (may exceed ``cap``: call again with more room), or -1 truncated, -2
 * unknown form, -3 unknown abbreviation code, -4 bad abbreviation table;
 * err_pos: where. For each DIE i and requested attribute j (index i * nw + j):
 * form (0 when absent; the real form of a DW_FORM_indirect value), pos (-1
 * absent), end, val (form_value: LEB128 forms decoded, else the little-endian
 * value of the first <= 8 bytes).
 * limit > 0: stop after that many DIEs (1: the unit DIE alone). */
int64_t lp_dies(const uint8_t *info, int64_t info_len, int64_t die, int64_t end,
                int version, int asz, int osz,
                const uint8_t *abbrev, int64_t abbrev_len, int64_t abbrev_off,
                const uint64_t *want, int nw,
                int64_t *off, int64_t *code_out, int64_t *tag_out,
                int32_t *form_out, int64_t *pos_out, int64_t *end_out, uint64_t *val_out,
                int64_t cap, int64_t limit, int64_t *err_pos) {
    sec_t si = {info, info_len}, sa = {abbrev, abbrev_len};
    atab_t t;
    if (atab_parse(&t, &sa, abbrev_off)) { atab_free(&t); *err_pos = abbrev_off; return -4; }
    if (end > info_len) end = info_len;
    int64_t p = die, n = 0;
    while (p < end && (limit <= 0 || n < limit)) {
        int64_t o = p;
        uint64_t code;
        if (rd_uleb(&si, &p, &code)) { *err_pos = o; atab_free(&t); return -1; }
        if (code == 0) continue;
        const abbrev_t *a = atab_get(&t, code);
        if (!a) { *err_pos = o; atab_free(&t); return -3; }
        int store = n < cap;
        if (store) {
            off[n] = o; code_out[n] = (int64_t)code; tag_out[n] = (int64_t)a->tag;
            for (int j = 0; j < nw; j++) {
                form_out[n * nw + j] = 0; pos_out[n * nw + j] = -1;
                end_out[n * nw + j] = -1; val_out[n * nw + j] = 0;
            }
        }
        for (int64_t k = 0; k < a->n; k++) {
            uint64_t f = t.sp[a->first + k].form, at = t.sp[a->first + k].attr;
            if (f == DW_FORM_indirect && rd_uleb(&si, &p, &f)) { *err_pos = p; atab_free(&t); return -1; }
            int64_t q = p;
            int r = skip_form(&si, &p, f, asz, osz, version);
            if (r) { *err_pos = q; atab_free(&t); return r == -2 ? -2 : -1; }
            if (store) {
                for (int j = 0; j < nw; j++) {
                    if (want[j] != at) continue;
                    int64_t x = n * nw + j;
                    form_out[x] = (int32_t)f; pos_out[x] = q; end_out[x] = p;
                    val_out[x] = form_value(&si, q, p, f);
                }
            }
        }
        n++;
    }
    atab_free(&t);
    return n;
}

/* ------------------------------------------------------------- segments */

/* Segment k maps old [old, end) to new [new, new_end) (see rewrite.Segments);
 * sorted by old, disjoint, so ``end`` is sorted too. */
typedef struct {
    const uint64_t *old, *end, *new_, *new_end; const uint8_t *collapse; int64_t n;
} sg_t;

static int64_t sg_after(const sg_t *s, uint64_t a) {          /* bisect_right(end, a) */
    int64_t lo = 0, hi = s->n;
    while (lo < hi) { int64_t m = (lo + hi) / 2; if (s->end[m] <= a) lo = m + 1; else hi = m; }
    return lo;
}

static void sg_place(const sg_t *s, int64_t k, uint64_t a, uint64_t b, uint64_t *na, uint64_t *nb) {
    if (s->collapse[k]) {
        *na = s->new_[k];
        *nb = b == s->end[k] ? s->new_end[k] : *na;
    } else {
        *na = s->new_[k] + (a - s->old[k]);
        *nb = b == s->end[k] ? s->new_end[k] : *na + (b - a);
    }
}

static int sg_map(const sg_t *s, uint64_t a, uint64_t *out) {
    int64_t k = sg_after(s, a);
    uint64_t nb;
    if (k < s->n && s->old[k] <= a) { sg_place(s, k, a, a, out, &nb); return 1; }
    if (k > 0 && s->end[k - 1] == a) { *out = s->new_end[k - 1]; return 1; }
    return 0;
}

typedef struct { uint64_t lo, hi; } rng_t;
typedef struct { rng_t *r; int64_t n, cap; } rvec_t;

static int rpush(rvec_t *v, uint64_t lo, uint64_t hi) {
    if (v->n == v->cap) {
        v->cap = v->cap ? 2 * v->cap : 64;
        rng_t *nr = realloc(v->r, sizeof(rng_t) * v->cap);
        if (!nr) return -1;
        v->r = nr;
    }
    v->r[v->n].lo = lo; v->r[v->n].hi = hi; v->n++;
    return 0;
}

/* Segments.ranges(lo, hi) appended to v (contiguous runs merged, old order). */
static int sg_ranges(const sg_t *s, uint64_t lo, uint64_t hi, rvec_t *v) {
    int64_t first = v->n;
    if (hi <= lo) return 0;
    for (int64_t k = sg_after(s, lo); k < s->n && s->old[k] < hi; k++) {
        uint64_t a = lo > s->old[k] ? lo : s->old[k];
        uint64_t b = hi < s->end[k] ? hi : s->end[k];
        uint64_t na, nb;
        sg_place(s, k, a, b, &na, &nb);
        if (nb <= na) continue;
        if (v->n > first && v->r[v->n - 1].hi == na) v->r[v->n - 1].hi = nb;
        else if (rpush(v, na, nb)) return -1;
    }
    return 0;
}

static int rcmp(const void *x, const void *y) {
    const rng_t *a = x, *b = y;
    if (a->lo != b->lo) return a->lo < b->lo ? -1 : 1;
    if (a->hi != b->hi) return a->hi < b->hi ? -1 : 1;
    return 0;
}

/* merge_ranges over v->r[first..]: sorted, empty ones dropped, overlapping or touching merged. */
static void rmerge(rvec_t *v, int64_t first) {
    int64_t n = v->n - first;
    rng_t *r = v->r + first;
    if (n > 1) qsort(r, (size_t)n, sizeof(rng_t), rcmp);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (r[i].hi <= r[i].lo) continue;
        if (m && r[i].lo <= r[m - 1].hi) { if (r[i].hi > r[m - 1].hi) r[m - 1].hi = r[i].hi; }
        else r[m++] = r[i];
    }
    v->n = first + m;
}

/* For each item: ranges of old [lo[i], hi[i]) (merge: sorted and merged) into
 * out_lo/out_hi (count[i] of them, in item order); linear[i] = 1 when the
 * unmerged translation is exactly [(map(lo), map(lo) + hi - lo)]. Returns the
 * total (may exceed cap: call again), -1 out of memory. */
int64_t lp_seg_ranges(const uint64_t *so, const uint64_t *se, const uint64_t *sn, const uint64_t *sne,
                      const uint8_t *sc, int64_t nseg,
                      int64_t n, const uint64_t *lo, const uint64_t *hi, int merge,
                      int64_t *count, uint8_t *linear, uint64_t *out_lo, uint64_t *out_hi, int64_t cap) {
    sg_t s = {so, se, sn, sne, sc, nseg};
    rvec_t v = {0, 0, 0};
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        v.n = 0;
        if (sg_ranges(&s, lo[i], hi[i], &v)) { free(v.r); return -1; }
        uint64_t m;
        linear[i] = v.n == 1 && sg_map(&s, lo[i], &m) && v.r[0].lo == m && v.r[0].hi == m + (hi[i] - lo[i]);
        if (merge) rmerge(&v, 0);
        count[i] = v.n;
        for (int64_t k = 0; k < v.n; k++, total++)
            if (total < cap) { out_lo[total] = v.r[k].lo; out_hi[total] = v.r[k].hi; }
    }
    free(v.r);
    return total;
}

/* ----------------------------------------------------------- list output */

/* One range list (rewrite._append_ranges' bytes). */
static int enc_ranges(buf_t *o, int v5, const rng_t *r, int64_t n) {
    int e = 0;
    if (v5) {
        for (int64_t k = 0; k < n; k++)
            e |= bput1(o, 7) | bput_le(o, r[k].lo, 8) | bput_uleb(o, r[k].hi - r[k].lo);
        e |= bput1(o, 0);
    } else {
        e |= bput_le(o, ~(uint64_t)0, 8) | bput_le(o, 0, 8);
        for (int64_t k = 0; k < n; k++) e |= bput_le(o, r[k].lo, 8) | bput_le(o, r[k].hi, 8);
        e |= bput_le(o, 0, 8) | bput_le(o, 0, 8);
    }
    return e;
}

/* Lists for items (count[i] ranges each, flat lo/hi) appended one after the
 * other; offsets[i] = base + where list i starts. Returns the byte count (may
 * exceed cap), -1 out of memory. */
int64_t lp_encode_ranges(int v5, int64_t n, const int64_t *count, const uint64_t *lo, const uint64_t *hi,
                         int64_t base, int64_t *offsets, uint8_t *out, int64_t cap) {
    buf_t o = {0, 0, 0};
    int64_t j = 0;
    rvec_t v = {0, 0, 0};
    for (int64_t i = 0; i < n; i++) {
        offsets[i] = base + o.n;
        v.n = 0;
        for (int64_t k = 0; k < count[i]; k++, j++) if (rpush(&v, lo[j], hi[j])) goto oom;
        if (enc_ranges(&o, v5, v.r, v.n)) goto oom;
    }
    if (o.n <= cap) memcpy(out, o.b, (size_t)o.n);
    free(v.r); free(o.b);
    return o.n;
oom:
    free(v.r); free(o.b);
    return -1;
}

/* ------------------------------------------------------------ list input */

/* DWARF 5 range list at off -> absolute ranges (encoding.read_rnglist). */
static int read_rnglist(const sec_t *s, int64_t p, uint64_t base, rvec_t *v) {
    for (;;) {
        uint64_t k, x, y;
        if (rd_le(s, p, 1, &k)) return -1;
        p++;
        switch (k) {
        case 0: return 0;
        case 4:
            if (rd_uleb(s, &p, &x) || rd_uleb(s, &p, &y) || rpush(v, base + x, base + y)) return -1;
            break;
        case 5: if (rd_le(s, p, 8, &base)) return -1; p += 8; break;
        case 6:
            if (rd_le(s, p, 8, &x) || rd_le(s, p + 8, 8, &y) || rpush(v, x, y)) return -1;
            p += 16; break;
        case 7:
            if (rd_le(s, p, 8, &x)) return -1;
            p += 8;
            if (rd_uleb(s, &p, &y) || rpush(v, x, x + y)) return -1;
            break;
        default: return -1;     /* *x forms need .debug_addr (never without split DWARF) */
        }
    }
}

/* DWARF 2-4 .debug_ranges list (encoding.read_ranges). */
static int read_ranges(const sec_t *s, int64_t p, uint64_t base, int asz, rvec_t *v) {
    uint64_t allones = asz >= 8 ? ~(uint64_t)0 : (((uint64_t)1 << (8 * asz)) - 1);
    for (;;) {
        uint64_t x, y;
        if (rd_le(s, p, asz, &x) || rd_le(s, p + asz, asz, &y)) return -1;
        p += 2 * asz;
        if (x == 0 && y == 0) return 0;
        if (x == allones) { base = y; continue; }
        if (rpush(v, base + x, base + y)) return -1;
    }
}

typedef struct { uint64_t lo, hi; int64_t e0, e1; int def; } loc_t;
typedef struct { loc_t *e; int64_t n, cap; } lvec_t;

static int lpush(lvec_t *v, uint64_t lo, uint64_t hi, int64_t e0, int64_t e1, int def) {
    if (v->n == v->cap) {
        v->cap = v->cap ? 2 * v->cap : 64;
        loc_t *ne = realloc(v->e, sizeof(loc_t) * v->cap);
        if (!ne) return -1;
        v->e = ne;
    }
    loc_t *x = &v->e[v->n++];
    x->lo = lo; x->hi = hi; x->e0 = e0; x->e1 = e1; x->def = def;
    return 0;
}

/* rewrite._read_loclist: entries (lo, hi, expression position, end); def = a
 * DWARF 5 default location (no range). */
static int read_loclist(const sec_t *s, int64_t p, uint64_t base, int v5, lvec_t *v) {
    if (!v5) {
        for (;;) {
            uint64_t x, y, n;
            if (rd_le(s, p, 8, &x) || rd_le(s, p + 8, 8, &y)) return -1;
            p += 16;
            if (x == 0 && y == 0) return 0;
            if (x == ~(uint64_t)0) { base = y; continue; }
            if (rd_le(s, p, 2, &n) || p + 2 + (int64_t)n > s->n) return -1;
            if (lpush(v, base + x, base + y, p, p + 2 + (int64_t)n, 0)) return -1;
            p += 2 + (int64_t)n;
        }
    }
    for (;;) {
        uint64_t k, x, y, lo = 0, hi = 0, n;
        int def = 0;
        if (rd_le(s, p, 1, &k)) return -1;
        p++;
        switch (k) {
        case 0: return 0;
        case 4:
            if (rd_uleb(s, &p, &x) || rd_uleb(s, &p, &y)) return -1;
            lo = base + x; hi = base + y; break;
        case 5: def = 1; break;
        case 6: if (rd_le(s, p, 8, &base)) return -1; p += 8; continue;
        case 7: if (rd_le(s, p, 8, &lo) || rd_le(s, p + 8, 8, &hi)) return -1; p += 16; break;
        case 8:
            if (rd_le(s, p, 8, &lo)) return -1;
            p += 8;
            if (rd_uleb(s, &p, &n)) return -1;
            hi = lo + n; break;
        case 9: if (rd_uleb(s, &p, &x) || rd_uleb(s, &p, &y)) return -1; continue;   /* GNU view pair */
        default: return -1;
        }
        int64_t e0 = p;
        if (rd_uleb(s, &p, &n) || n > (uint64_t)(s->n - p)) return -1;
        if (lpush(v, lo, hi, e0, p + (int64_t)n, def)) return -1;
        p += (int64_t)n;
    }
}

/* Areas appended to the four list sections: 0 .debug_rnglists, 1 .debug_ranges,
 * 2 .debug_loclists, 3 .debug_loc. A DWARF 5 area starts with a contribution
 * header (unit_length filled in by the caller) when it did not exist yet. */
typedef struct { buf_t o; int64_t orig_len, tail_len; int exists, v5; } area_t;

static int area_open(area_t *a) {
    if (a->exists) return 0;
    a->exists = 1;
    if (!a->v5) return 0;
    static const uint8_t hdr[12] = {0, 0, 0, 0, 5, 0, 8, 0, 0, 0, 0, 0};
    return bput(&a->o, hdr, 12);
}
static int64_t area_off(const area_t *a) { return a->orig_len + a->tail_len + a->o.n; }

/* rewrite.rebase_lists' per-list work, for every item in order: list v[i]
 * (field p[i]) read with base[i] (ranges, or locations when is_loc[i]; DWARF 5
 * sections when v5[i]), translated and appended to its area; a location list's
 * GNU views list (field vp[i] >= 0; its offset read from ``info``) is copied
 * entry for entry in front of it. noff/voff: the new offsets to store;
 * status[i] = 1 when the list cannot be read (left as it is). Sections: 0-3 the
 * original list sections (rnglists, ranges, loclists, loc), 4-5 the patched
 * loclists and loc (expressions are copied from these). orig_len/tail_len/
 * exists per area; out: the bytes appended per area (out_len[a]; may exceed
 * out_cap[a]: call again). Returns 0, -1 out of memory. */
int64_t lp_relist(const uint64_t *so, const uint64_t *se, const uint64_t *sn, const uint64_t *sne,
                  const uint8_t *sc, int64_t nseg,
                  const uint8_t *info, int64_t info_len,
                  const uint8_t **secs, const int64_t *sec_len,
                  int64_t n, const int64_t *p, const int64_t *v, const uint64_t *base,
                  const uint8_t *v5, const uint8_t *is_loc, const int64_t *vp, const uint8_t *asz,
                  const int64_t *orig_len, const int64_t *tail_len, const uint8_t *exists,
                  int64_t *noff, int64_t *voff, uint8_t *status,
                  uint8_t **out, const int64_t *out_cap, int64_t *out_len) {
    (void)p;
    sg_t s = {so, se, sn, sne, sc, nseg};
    sec_t sx[6];
    for (int i = 0; i < 6; i++) { sx[i].b = secs[i]; sx[i].n = secs[i] ? sec_len[i] : 0; }
    sec_t si = {info, info_len};
    area_t ar[4];
    memset(ar, 0, sizeof ar);
    for (int a = 0; a < 4; a++) {
        ar[a].orig_len = orig_len[a]; ar[a].tail_len = tail_len[a]; ar[a].exists = exists[a];
        ar[a].v5 = a == 0 || a == 2;
    }
    rvec_t old = {0, 0, 0}, nw = {0, 0, 0};
    lvec_t ents = {0, 0, 0};
    buf_t body = {0, 0, 0}, views = {0, 0, 0};
    uint64_t *vx = NULL; int64_t vcap = 0;
    int64_t rc = 0;
    for (int64_t i = 0; i < n; i++) {
        noff[i] = voff[i] = -1; status[i] = 0;
        if (!is_loc[i]) {
            const sec_t *src = v5[i] ? &sx[0] : &sx[1];
            old.n = 0;
            int r = v5[i] ? read_rnglist(src, v[i], base[i], &old) : read_ranges(src, v[i], base[i], asz[i], &old);
            if (r) { status[i] = 1; continue; }
            nw.n = 0;
            for (int64_t k = 0; k < old.n; k++)
                if (sg_ranges(&s, old.r[k].lo, old.r[k].hi, &nw)) { rc = -1; goto done; }
            rmerge(&nw, 0);
            area_t *A = &ar[v5[i] ? 0 : 1];
            if (area_open(A)) { rc = -1; goto done; }
            noff[i] = area_off(A);
            if (enc_ranges(&A->o, v5[i], nw.r, nw.n)) { rc = -1; goto done; }
            continue;
        }
        int li = v5[i] ? 2 : 3;
        const sec_t *src = &sx[li], *pat = &sx[li + 2];
        ents.n = 0;
        if (read_loclist(src, v[i], base[i], v5[i], &ents)) { status[i] = 1; continue; }
        int64_t nv = 0;
        if (vp[i] >= 0) {
            uint64_t q;
            if (rd_le(&si, vp[i], 4, &q)) { status[i] = 1; continue; }
            int64_t pq = (int64_t)q, bad = 0;
            for (int64_t k = 0; k < ents.n; k++) {
                if (ents.e[k].def) continue;
                if (2 * nv + 2 > vcap) {
                    vcap = vcap ? 2 * vcap : 256;
                    uint64_t *nx = realloc(vx, sizeof(uint64_t) * vcap);
                    if (!nx) { rc = -1; goto done; }
                    vx = nx;
                }
                if (rd_uleb(src, &pq, &vx[2 * nv]) || rd_uleb(src, &pq, &vx[2 * nv + 1])) { bad = 1; break; }
                nv++;
            }
            if (bad) { status[i] = 1; continue; }
        }
        int bad = 0;
        for (int64_t k = 0; k < ents.n; k++)
            if (ents.e[k].e1 > pat->n) bad = 1;
        if (bad) { status[i] = 1; continue; }
        area_t *A = &ar[li];
        if (area_open(A)) { rc = -1; goto done; }
        body.n = views.n = 0;
        if (!v5[i]) { if (bput_le(&body, ~(uint64_t)0, 8) || bput_le(&body, 0, 8)) { rc = -1; goto done; } }
        int64_t j = 0;
        for (int64_t k = 0; k < ents.n; k++) {
            const loc_t *e = &ents.e[k];
            const uint8_t *ex = pat->b + e->e0;
            int64_t exn = e->e1 - e->e0;
            if (e->def) {
                if (v5[i] && (bput1(&body, 5) || bput(&body, ex, exn))) { rc = -1; goto done; }
                continue;
            }
            uint64_t w0 = 0, w1 = 0;
            if (j < nv) { w0 = vx[2 * j]; w1 = vx[2 * j + 1]; }
            j++;
            nw.n = 0;
            if (e->hi > e->lo) {
                if (sg_ranges(&s, e->lo, e->hi, &nw)) { rc = -1; goto done; }
            } else {
                uint64_t m;
                if (sg_map(&s, e->lo, &m) && rpush(&nw, m, m)) { rc = -1; goto done; }
            }
            for (int64_t r = 0; r < nw.n; r++) {
                int err = v5[i] ? (bput1(&body, 8) | bput_le(&body, nw.r[r].lo, 8) |
                                   bput_uleb(&body, nw.r[r].hi - nw.r[r].lo))
                                : (bput_le(&body, nw.r[r].lo, 8) | bput_le(&body, nw.r[r].hi, 8));
                err |= bput(&body, ex, exn);
                if (vp[i] >= 0) err |= bput_uleb(&views, w0) | bput_uleb(&views, w1);
                if (err) { rc = -1; goto done; }
            }
        }
        if (v5[i] ? bput1(&body, 0) : (bput_le(&body, 0, 8) | bput_le(&body, 0, 8))) { rc = -1; goto done; }
        if (vp[i] >= 0) {
            voff[i] = area_off(A);
            if (bput(&A->o, views.b, views.n)) { rc = -1; goto done; }
        }
        noff[i] = area_off(A);
        if (bput(&A->o, body.b, body.n)) { rc = -1; goto done; }
    }
done:
    for (int a = 0; a < 4; a++) {
        out_len[a] = ar[a].o.n;
        if (rc == 0 && ar[a].o.n <= out_cap[a] && ar[a].o.n) memcpy(out[a], ar[a].o.b, (size_t)ar[a].o.n);
        free(ar[a].o.b);
    }
    free(old.r); free(nw.r); free(ents.e); free(body.b); free(views.b); free(vx);
    return rc;
}

/* DW_AT_ranges lists read into absolute ranges: item i at off[i] with base[i]
 * (DWARF 5 rnglists when v5, else .debug_ranges with asz); count[i] ranges
 * (-1: unreadable) into out_lo/out_hi. Returns the total (may exceed cap). */
int64_t lp_read_lists(const uint8_t *sec, int64_t sec_len, int v5, int asz,
                      int64_t n, const int64_t *off, const uint64_t *base,
                      int64_t *count, uint64_t *out_lo, uint64_t *out_hi, int64_t cap) {
    sec_t s = {sec, sec ? sec_len : 0};
    rvec_t v = {0, 0, 0};
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        v.n = 0;
        int r = v5 ? read_rnglist(&s, off[i], base[i], &v) : read_ranges(&s, off[i], base[i], asz, &v);
        if (r) { count[i] = -1; continue; }
        count[i] = v.n;
        for (int64_t k = 0; k < v.n; k++, total++)
            if (total < cap) { out_lo[total] = v.r[k].lo; out_hi[total] = v.r[k].hi; }
    }
    free(v.r);
    return total;
}

/* ------------------------------------------------- abbreviation tables out */

static int bput_sleb(buf_t *o, int64_t v) {
    for (;;) {
        uint8_t c = v & 0x7f;
        v >>= 7;                                   /* arithmetic shift */
        int done = (v == 0 && !(c & 0x40)) || (v == -1 && (c & 0x40));
        if (bput1(o, done ? c : (c | 0x80))) return -1;
        if (done) return 0;
    }
}

typedef struct { uint64_t code; int64_t start, end; int64_t seq; } ent_t;

/* Scan the table at off: every entry's code and byte span [start, end). */
static int64_t scan_table(const sec_t *s, int64_t off, ent_t **out) {
    int64_t p = off, n = 0, cap = 0;
    ent_t *e = NULL;
    for (;;) {
        int64_t st = p;
        uint64_t code, tag, at, form;
        if (rd_uleb(s, &p, &code)) goto bad;
        if (code == 0) break;
        if (rd_uleb(s, &p, &tag) || p >= s->n) goto bad;
        p++;
        for (;;) {
            if (rd_uleb(s, &p, &at) || rd_uleb(s, &p, &form)) goto bad;
            if (form == DW_FORM_implicit_const) { int64_t ic; if (rd_sleb(s, &p, &ic)) goto bad; }
            else if (at == 0 && form == 0) break;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 256;
            ent_t *ne = realloc(e, sizeof(ent_t) * cap);
            if (!ne) goto bad;
            e = ne;
        }
        e[n].code = code; e[n].start = st; e[n].end = p; e[n].seq = n; n++;
    }
    *out = e;
    return n;
bad:
    free(e);
    return -1;
}

/* One entry (the last one with ``code``, as a dict keeps it): tag, children
 * and up to cap (attr, form, implicit const, has const) specs; returns the
 * spec count, -1 code absent, -2 malformed table. */
int64_t lp_abbrev_entry(const uint8_t *ab, int64_t ab_len, int64_t off, uint64_t code,
                        uint64_t *tag, int64_t *children, uint64_t *at, uint64_t *form, int64_t *ic,
                        uint8_t *has_ic, int64_t cap) {
    sec_t s = {ab, ab_len};
    ent_t *e = NULL;
    int64_t n = scan_table(&s, off, &e);
    if (n < 0) return -2;
    int64_t hit = -1;
    for (int64_t i = 0; i < n; i++) if (e[i].code == code) hit = i;
    if (hit < 0) { free(e); return -1; }
    int64_t p = e[hit].start, k = 0;
    free(e);
    uint64_t c = 0, t = 0, a = 0, f = 0;
    rd_uleb(&s, &p, &c); rd_uleb(&s, &p, &t);
    *tag = t; *children = s.b[p++];
    for (;;) {
        int64_t v = 0; int h = 0;
        rd_uleb(&s, &p, &a); rd_uleb(&s, &p, &f);
        if (f == DW_FORM_implicit_const) { rd_sleb(&s, &p, &v); h = 1; }
        else if (a == 0 && f == 0) break;
        if (k < cap) { at[k] = a; form[k] = f; ic[k] = v; has_ic[k] = (uint8_t)h; }
        k++;
    }
    return k;
}

static int ecmp(const void *x, const void *y) {
    const ent_t *a = x, *b = y;
    if (a->code != b->code) return a->code < b->code ? -1 : 1;
    return a->seq < b->seq ? -1 : (a->seq > b->seq);
}

/* encoding.encode_abbrevs of (the table at off, updated with the mods): every
 * entry re-encoded (canonical LEB128), in code order, the last entry of a
 * code winning, mod i (code mod_codes[i], its encoded entry
 * mod_bytes[mod_off[i]..mod_off[i + 1]]) replacing or adding its code; then
 * the terminating 0. Returns the length (may exceed cap), -1 malformed. */
int64_t lp_abbrev_table(const uint8_t *ab, int64_t ab_len, int64_t off, int64_t nmods,
                        const uint64_t *mod_codes, const uint8_t *mod_bytes, const int64_t *mod_off,
                        uint8_t *out, int64_t cap) {
    sec_t s = {ab, ab_len};
    ent_t *e = NULL;
    int64_t n = scan_table(&s, off, &e);
    if (n < 0) return -1;
    ent_t *all = realloc(e, sizeof(ent_t) * (size_t)(n + nmods + 1));
    if (!all) { free(e); return -1; }
    e = all;
    for (int64_t i = 0; i < nmods; i++) {         /* a mod: start < 0 names it */
        e[n].code = mod_codes[i]; e[n].start = -1 - i; e[n].end = 0; e[n].seq = n; n++;
    }
    qsort(e, (size_t)n, sizeof(ent_t), ecmp);
    buf_t o = {0, 0, 0};
    int err = 0;
    for (int64_t i = 0; i < n && !err; i++) {
        if (i + 1 < n && e[i + 1].code == e[i].code) continue;     /* a later one wins */
        if (e[i].start < 0) {
            int64_t m = -1 - e[i].start;
            err |= bput(&o, mod_bytes + mod_off[m], mod_off[m + 1] - mod_off[m]);
            continue;
        }
        int64_t p = e[i].start;
        uint64_t c = 0, t = 0, a = 0, f = 0;
        rd_uleb(&s, &p, &c); rd_uleb(&s, &p, &t);
        err |= bput_uleb(&o, c) | bput_uleb(&o, t) | bput1(&o, s.b[p++]);
        for (;;) {
            rd_uleb(&s, &p, &a); rd_uleb(&s, &p, &f);
            if (f == DW_FORM_implicit_const) {
                int64_t v; rd_sleb(&s, &p, &v);
                err |= bput_uleb(&o, a) | bput_uleb(&o, f) | bput_sleb(&o, v);
            } else if (a == 0 && f == 0) break;
            else err |= bput_uleb(&o, a) | bput_uleb(&o, f);
        }
        err |= bput1(&o, 0) | bput1(&o, 0);
    }
    err |= bput1(&o, 0);
    free(e);
    int64_t len = err ? -1 : o.n;
    if (!err && o.n <= cap) memcpy(out, o.b, (size_t)o.n);
    free(o.b);
    return len;
}

/* The first DIE of each of n units (lp_dies with limit 1, in one call): per
 * unit i, row i of the outputs; off[i] = -1 when the unit's first entry cannot
 * be read (unknown abbreviation, truncated: no attributes, as
 * encoding.top_die_attrs sees it) or is a null entry. Returns 0, or -2 for an
 * unknown attribute form (err_pos: where). */
int64_t lp_top_dies(const uint8_t *info, int64_t info_len, int64_t n, const int64_t *die,
                    const int64_t *end, const int64_t *version, const int64_t *asz, const int64_t *osz,
                    const int64_t *abbrev_off, const uint8_t *abbrev, int64_t abbrev_len,
                    const uint64_t *want, int nw,
                    int64_t *off, int64_t *code_out, int64_t *tag_out,
                    int32_t *form_out, int64_t *pos_out, int64_t *end_out, uint64_t *val_out,
                    int64_t *err_pos) {
    for (int64_t i = 0; i < n; i++) {
        int64_t e = 0;
        int64_t r = lp_dies(info, info_len, die[i], end[i], (int)version[i], (int)asz[i], (int)osz[i],
                            abbrev, abbrev_len, abbrev_off[i], want, nw, off + i, code_out + i,
                            tag_out + i, form_out + i * nw, pos_out + i * nw, end_out + i * nw,
                            val_out + i * nw, 1, 1, &e);
        if (r == -2) { *err_pos = e; return -2; }
        if (r < 1 || off[i] != die[i]) {
            off[i] = -1;
            for (int j = 0; j < nw; j++) { pos_out[i * nw + j] = -1; form_out[i * nw + j] = 0; }
        }
    }
    return 0;
}

/* merge_ranges over groups: group g is items first[g]..first[g + 1] - 1, and
 * its ranges are the translations of all of them, sorted and merged into
 * count[g] ranges. Returns the total (may exceed cap), -1 out of memory. */
int64_t lp_seg_ranges_grouped(const uint64_t *so, const uint64_t *se, const uint64_t *sn,
                              const uint64_t *sne, const uint8_t *sc, int64_t nseg,
                              const uint64_t *lo, const uint64_t *hi, int64_t ngroups,
                              const int64_t *first, int64_t *count, uint64_t *out_lo,
                              uint64_t *out_hi, int64_t cap) {
    sg_t s = {so, se, sn, sne, sc, nseg};
    rvec_t v = {0, 0, 0};
    int64_t total = 0;
    for (int64_t g = 0; g < ngroups; g++) {
        v.n = 0;
        for (int64_t i = first[g]; i < first[g + 1]; i++)
            if (sg_ranges(&s, lo[i], hi[i], &v)) { free(v.r); return -1; }
        rmerge(&v, 0);
        count[g] = v.n;
        for (int64_t k = 0; k < v.n; k++, total++)
            if (total < cap) { out_lo[total] = v.r[k].lo; out_hi[total] = v.r[k].hi; }
    }
    free(v.r);
    return total;
}
