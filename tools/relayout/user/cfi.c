/* The plain part of cfi.py in C: evaluate an FDE's CFI program into rows,
 * write a program back from rows, and both together (an FDE's compaction, a
 * split part's program from its pieces).
 *
 * "Plain" is what gcc writes on x86-64: a CFA of register + offset, register
 * rules off/valoff/reg/undef/same, registers 0..31, GNU_args_size. Anything
 * else (CFA or register expressions, another register, an opcode or encoding
 * this file does not know, a malformed program, a value past 63 bits, a rule's
 * value past 32) returns
 * CFI_FALLBACK and the caller runs cfi.py's Python code, which decides (and
 * raises what it raises). Where both run they must produce the same rows and
 * the same program bytes: every rule below mirrors cfi.py's line for line.
 */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CFI_OK 0
#define CFI_FALLBACK 1
#define NREG 32
#define STACK_MAX 64

enum { R_NONE = 0, R_OFF = 1, R_VALOFF = 2, R_REG = 3, R_UNDEF = 4, R_SAME = 5 };

/* One row: its location and the state there. Every byte is written (no
 * implicit padding, absent registers zero), so equal states are equal bytes:
 * the Python side compares rows by their bytes. */
typedef struct {
    int64_t loc;
    int64_t cfa_off;
    int64_t args;
    int32_t cfa_reg;
    uint32_t present;          /* bit r: register r has a rule */
    uint8_t kind[NREG];
    int32_t val[NREG];         /* a rule's offset or register (wider: Python's) */
} row_t;

/* What a program needs from its CIE; ``init`` its initial state (loc 0). */
typedef struct {
    int64_t code_align;
    int64_t data_align;
    row_t init;
} cie_t;

#define STATE_OFF offsetof(row_t, cfa_off)
#define STATE_LEN (sizeof(row_t) - STATE_OFF)     /* 184: a multiple of 8 */

static int same_state(const row_t *a, const row_t *b)
{
    return memcmp((const char *)a + STATE_OFF, (const char *)b + STATE_OFF, STATE_LEN) == 0;
}

/* ---------------------------------------------------------------- reading */

typedef struct {
    const uint8_t *d;
    int64_t n, pos;
    int bad;
} reader_t;

static uint64_t rd_uleb(reader_t *r)
{
    uint64_t v = 0;
    int shift = 0;
    for (;;) {
        if (r->pos >= r->n || shift > 56) { r->bad = 1; return 0; }   /* 63 bits at most */
        uint8_t b = r->d[r->pos++];
        v |= (uint64_t)(b & 0x7F) << shift;
        shift += 7;
        if (b < 0x80) return v;
    }
}

static int64_t rd_sleb(reader_t *r)
{
    uint64_t v = 0;
    int shift = 0;
    uint8_t b;
    for (;;) {
        if (r->pos >= r->n) { r->bad = 1; return 0; }
        b = r->d[r->pos++];
        if (shift > 56) { r->bad = 1; return 0; }     /* keeps the value inside 63 bits */
        v |= (uint64_t)(b & 0x7F) << shift;
        shift += 7;
        if (b < 0x80) break;
    }
    if (b & 0x40)
        v |= ~(uint64_t)0 << shift;                   /* sign: shift <= 63 here */
    return (int64_t)v;
}

static int mul(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* ------------------------------------------------------------- evaluating */

typedef struct {
    int64_t cfa_off;
    int32_t cfa_reg;
    uint32_t present;
    uint8_t kind[NREG];
    int32_t val[NREG];
} saved_t;

static int set_rule(row_t *s, int r, int kind, int64_t val)
{
    if (val < INT32_MIN || val > INT32_MAX)
        return 0;
    s->present |= 1u << r;
    s->kind[r] = (uint8_t)kind;
    s->val[r] = (int32_t)val;
    return 1;
}

static void restore_rule(row_t *s, const row_t *init, int r)
{
    if (init->present & (1u << r)) {
        set_rule(s, r, init->kind[r], init->val[r]);
    } else {
        s->present &= ~(1u << r);
        s->kind[r] = 0;
        s->val[r] = 0;
    }
}

/* rows must hold n + 1 entries (one per advance, one at the end). *used:
 * the program's length without trailing DW_CFA_nop padding. */
static int evaluate(const uint8_t *prog, int64_t n, const cie_t *cie, row_t *rows,
                    int64_t *nrows, int64_t *used_out)
{
    row_t cur = cie->init;
    saved_t stack[STACK_MAX];
    int depth = 0;
    int64_t loc = 0, used = 0, cnt = 0;
    const int64_t ca = cie->code_align, da = cie->data_align;
    reader_t rd = { prog, n, 0, 0 };
    cur.loc = 0;

#define EMIT(newloc) do { \
        if (cnt && rows[cnt - 1].loc == loc) rows[cnt - 1] = cur, rows[cnt - 1].loc = loc; \
        else { rows[cnt] = cur; rows[cnt].loc = loc; cnt++; } \
        loc = (newloc); } while (0)
#define REG(x) do { if ((x) >= NREG) return CFI_FALLBACK; } while (0)

    while (rd.pos < n) {
        uint8_t op = prog[rd.pos++];
        int hi = op & 0xC0, lo = op & 0x3F;
        int64_t v, nl;
        uint64_t r, r2;
        if (hi == 0x40) {
            if (!mul(lo, ca, &v) || __builtin_add_overflow(loc, v, &nl)) return CFI_FALLBACK;
            EMIT(nl);
            used = rd.pos;
            continue;
        }
        if (hi == 0x80) {
            REG(lo);
            v = (int64_t)rd_uleb(&rd);
            if (rd.bad || !mul(v, da, &v)) return CFI_FALLBACK;
            if (!set_rule(&cur, lo, R_OFF, v)) return CFI_FALLBACK;
            used = rd.pos;
            continue;
        }
        if (hi == 0xC0) {
            REG(lo);
            restore_rule(&cur, &cie->init, lo);
            used = rd.pos;
            continue;
        }
        switch (op) {
        case 0x00:                  /* DW_CFA_nop: padding, not counted in used */
            continue;
        case 0x02: case 0x03: case 0x04: {
            int w = op == 0x02 ? 1 : op == 0x03 ? 2 : 4;
            uint64_t d = 0;
            if (rd.pos + w > n) return CFI_FALLBACK;
            for (int k = 0; k < w; k++) d |= (uint64_t)prog[rd.pos + k] << (8 * k);
            rd.pos += w;
            if (!mul((int64_t)d, ca, &v) || __builtin_add_overflow(loc, v, &nl))
                return CFI_FALLBACK;
            EMIT(nl);
            break;
        }
        case 0x05: case 0x11:
            r = rd_uleb(&rd);
            v = op == 0x05 ? (int64_t)rd_uleb(&rd) : rd_sleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            REG(r);
            if (!mul(v, da, &v)) return CFI_FALLBACK;
            if (!set_rule(&cur, (int)r, R_OFF, v)) return CFI_FALLBACK;
            break;
        case 0x06: case 0x07: case 0x08:
            r = rd_uleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            REG(r);
            if (op == 0x06) restore_rule(&cur, &cie->init, (int)r);
            else set_rule(&cur, (int)r, op == 0x07 ? R_UNDEF : R_SAME, 0);
            break;
        case 0x09:
            r = rd_uleb(&rd);
            r2 = rd_uleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            REG(r);
            if (!set_rule(&cur, (int)r, R_REG, (int64_t)r2)) return CFI_FALLBACK;
            break;
        case 0x0A: {
            if (depth == STACK_MAX) return CFI_FALLBACK;
            saved_t *s = &stack[depth++];
            s->cfa_off = cur.cfa_off;
            s->cfa_reg = cur.cfa_reg;
            s->present = cur.present;
            memcpy(s->kind, cur.kind, sizeof s->kind);
            memcpy(s->val, cur.val, sizeof s->val);
            break;
        }
        case 0x0B: {                /* args_size is not part of the remembered state */
            if (!depth) return CFI_FALLBACK;
            saved_t *s = &stack[--depth];
            cur.cfa_off = s->cfa_off;
            cur.cfa_reg = s->cfa_reg;
            cur.present = s->present;
            memcpy(cur.kind, s->kind, sizeof s->kind);
            memcpy(cur.val, s->val, sizeof s->val);
            break;
        }
        case 0x0C: case 0x12:
            r = rd_uleb(&rd);
            v = op == 0x0C ? (int64_t)rd_uleb(&rd) : rd_sleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            REG(r);
            if (op == 0x12 && !mul(v, da, &v)) return CFI_FALLBACK;
            cur.cfa_reg = (int32_t)r;
            cur.cfa_off = v;
            break;
        case 0x0D:
            r = rd_uleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            REG(r);
            cur.cfa_reg = (int32_t)r;
            break;
        case 0x0E: case 0x13:
            v = op == 0x0E ? (int64_t)rd_uleb(&rd) : rd_sleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            if (op == 0x13 && !mul(v, da, &v)) return CFI_FALLBACK;
            cur.cfa_off = v;
            break;
        case 0x14: case 0x15:
            r = rd_uleb(&rd);
            v = op == 0x14 ? (int64_t)rd_uleb(&rd) : rd_sleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            REG(r);
            if (!mul(v, da, &v)) return CFI_FALLBACK;
            if (!set_rule(&cur, (int)r, R_VALOFF, v)) return CFI_FALLBACK;
            break;
        case 0x2E:
            v = (int64_t)rd_uleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            cur.args = v;
            break;
        case 0x2F:
            r = rd_uleb(&rd);
            v = (int64_t)rd_uleb(&rd);
            if (rd.bad) return CFI_FALLBACK;
            REG(r);
            if (!mul(-v, da, &v)) return CFI_FALLBACK;
            if (!set_rule(&cur, (int)r, R_OFF, v)) return CFI_FALLBACK;
            break;
        default:                    /* expressions, set_loc, ...: Python's */
            return CFI_FALLBACK;
        }
        used = rd.pos;
    }
    EMIT(loc);
#undef EMIT
#undef REG
    *nrows = cnt;
    *used_out = used;
    return CFI_OK;
}

/* ---------------------------------------------------------------- writing */

typedef struct {
    uint8_t *p;
    int64_t n, cap;
    int bad;
} buf_t;

static void put(buf_t *b, uint8_t c)
{
    if (b->n == b->cap) {
        int64_t cap = b->cap ? 2 * b->cap : 256;
        uint8_t *p = realloc(b->p, cap);
        if (!p) { b->bad = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    b->p[b->n++] = c;
}

static void put_uleb(buf_t *b, uint64_t v)
{
    do {
        uint8_t c = v & 0x7F;
        v >>= 7;
        put(b, v ? c | 0x80 : c);
    } while (v);
}

static void put_sleb(buf_t *b, int64_t v)
{
    for (;;) {
        uint8_t c = v & 0x7F;
        v >>= 7;                    /* arithmetic, as Python's >> */
        if ((v == 0 && !(c & 0x40)) || (v == -1 && (c & 0x40))) { put(b, c); return; }
        put(b, c | 0x80);
    }
}

static int64_t floordiv(int64_t a, int64_t b)
{
    int64_t q = a / b;
    if ((a % b) && ((a < 0) != (b < 0))) q--;
    return q;
}

/* cfi.py _set_rule: register r's rule becomes b's (absent: b has none) */
static int put_rule(buf_t *o, int r, const row_t *b, const cie_t *cie)
{
    const row_t *init = &cie->init;
    int has = (b->present >> r) & 1, ihas = (init->present >> r) & 1;
    if (has == ihas && (!has || (b->kind[r] == init->kind[r] && b->val[r] == init->val[r]))) {
        put(o, 0xC0 | r);
        return CFI_OK;
    }
    if (!has)                       /* a rule dropped where the CIE has one */
        return CFI_FALLBACK;
    int64_t v = b->val[r], da = cie->data_align;
    switch (b->kind[r]) {
    case R_OFF: case R_VALOFF: {
        if (v % da) return CFI_FALLBACK;
        int64_t f = v / da;
        if (b->kind[r] == R_OFF) {
            if (f >= 0) { put(o, 0x80 | r); put_uleb(o, (uint64_t)f); }
            else { put(o, 0x11); put_uleb(o, r); put_sleb(o, f); }
        } else {
            put(o, 0x15); put_uleb(o, r); put_sleb(o, f);
        }
        return CFI_OK;
    }
    case R_UNDEF: put(o, 0x07); put_uleb(o, r); return CFI_OK;
    case R_SAME: put(o, 0x08); put_uleb(o, r); return CFI_OK;
    case R_REG: put(o, 0x09); put_uleb(o, r); put_uleb(o, (uint64_t)v); return CFI_OK;
    }
    return CFI_FALLBACK;
}

/* cfi.py diff: instructions turning state a into state b */
static int put_diff(buf_t *o, const row_t *a, const row_t *b, const cie_t *cie)
{
    int64_t da = cie->data_align;
    if (a->cfa_reg != b->cfa_reg || a->cfa_off != b->cfa_off) {
        if (a->cfa_reg == b->cfa_reg) {
            if (b->cfa_off >= 0) { put(o, 0x0E); put_uleb(o, (uint64_t)b->cfa_off); }
            else { put(o, 0x13); put_sleb(o, floordiv(b->cfa_off, da)); }
        } else if (a->cfa_off == b->cfa_off) {
            put(o, 0x0D); put_uleb(o, (uint64_t)b->cfa_reg);
        } else if (b->cfa_off >= 0) {
            put(o, 0x0C); put_uleb(o, (uint64_t)b->cfa_reg); put_uleb(o, (uint64_t)b->cfa_off);
        } else {
            put(o, 0x12); put_uleb(o, (uint64_t)b->cfa_reg); put_sleb(o, floordiv(b->cfa_off, da));
        }
    }
    uint32_t regs = a->present | b->present;
    for (int r = 0; r < NREG; r++) {
        if (!((regs >> r) & 1))
            continue;
        if (((a->present ^ b->present) >> r) & 1 || a->kind[r] != b->kind[r] ||
            a->val[r] != b->val[r])
            if (put_rule(o, r, b, cie) != CFI_OK)
                return CFI_FALLBACK;
    }
    if (a->args != b->args) { put(o, 0x2E); put_uleb(o, (uint64_t)b->args); }
    return CFI_OK;
}

static int64_t diff_len(const row_t *a, const row_t *b, const cie_t *cie, buf_t *scratch)
{
    scratch->n = 0;
    if (put_diff(scratch, a, b, cie) != CFI_OK || scratch->bad)
        return -1;
    return scratch->n;
}

static int put_advance(buf_t *o, int64_t delta, int64_t ca)
{
    if (delta < 0 || delta % ca) return CFI_FALLBACK;
    int64_t v = delta / ca;
    if (v < 0x40) put(o, 0x40 | (uint8_t)v);
    else if (v < 0x100) { put(o, 0x02); put(o, (uint8_t)v); }
    else if (v < 0x10000) { put(o, 0x03); put(o, v & 0xFF); put(o, (v >> 8) & 0xFF); }
    else if (v <= 0xFFFFFFFFLL) {
        put(o, 0x04);
        for (int k = 0; k < 4; k++) put(o, (v >> (8 * k)) & 0xFF);
    } else return CFI_FALLBACK;
    return CFI_OK;
}

static uint64_t state_hash(const row_t *s)
{
    uint64_t h = 1469598103934665603ULL, w;
    const char *p = (const char *)s + STATE_OFF;
    for (size_t k = 0; k + 8 <= STATE_LEN; k += 8) {
        memcpy(&w, p + k, 8);
        h = (h ^ w) * 1099511628211ULL;
        h ^= h >> 29;
    }
    return h;
}

/* cfi.py write_program. rows: n rows (sorted by location; changed in place:
 * merged as write_program merges them). */
static int write_program(row_t *rows, int64_t n, const cie_t *cie, buf_t *out)
{
    int64_t m = 0;
    for (int64_t k = 0; k < n; k++) {
        if (m && same_state(&rows[m - 1], &rows[k])) continue;
        if (m && rows[m - 1].loc == rows[k].loc) { rows[m - 1] = rows[k]; continue; }
        rows[m++] = rows[k];
    }
    /* last[i]: the last seq entry with seq[i]'s state (write_program's ``last``;
     * the hash only finds candidates, the exact comparison decides) */
    int64_t size = 1;
    while (size < 2 * m) size <<= 1;
    int64_t *slot = malloc(sizeof(int64_t) * size);
    int64_t *last = malloc(sizeof(int64_t) * (m + 1));
    buf_t s1 = {0}, s2 = {0};
    int rc = CFI_OK;
    if (!slot || !last) { rc = CFI_FALLBACK; goto done; }
    for (int64_t k = 0; k < size; k++) slot[k] = -1;
    for (int64_t i = m - 1; i >= 0; i--) {          /* from the end: the first seen is the last */
        uint64_t h = state_hash(&rows[i]) & (size - 1);
        while (slot[h] >= 0 && !same_state(&rows[slot[h]], &rows[i]))
            h = (h + 1) & (size - 1);
        if (slot[h] < 0) slot[h] = i;
        last[i] = slot[h];
    }
    const row_t *cur = &cie->init;
    const row_t *remembered = NULL;
    int64_t loc = 0;
    for (int64_t i = 0; i < m; i++) {
        const row_t *st = &rows[i];
        if (st->loc != loc) {
            if (put_advance(out, st->loc - loc, cie->code_align) != CFI_OK) {
                rc = CFI_FALLBACK;
                goto done;
            }
            loc = st->loc;
        }
        if (remembered && same_state(st, remembered) && cur->args == st->args) {
            put(out, 0x0B);
            remembered = NULL;
            cur = st;
            continue;
        }
        int64_t step = diff_len(cur, st, cie, &s1);
        if (step < 0) { rc = CFI_FALLBACK; goto done; }
        /* cur (seq[i-1]'s state when i > 0) comes back after i */
        if (!remembered && step > 1 && i > 0 && last[i - 1] > i) {
            int64_t back = diff_len(st, cur, cie, &s2);
            if (back < 0) { rc = CFI_FALLBACK; goto done; }
            if (back > 1) {
                put(out, 0x0A);
                remembered = cur;
            }
        }
        for (int64_t k = 0; k < step; k++) put(out, s1.p[k]);
        cur = st;
    }
    if (out->bad || s1.bad || s2.bad) rc = CFI_FALLBACK;
done:
    free(slot);
    free(last);
    free(s1.p);
    free(s2.p);
    return rc;
}

/* ------------------------------------------------------------------ entry */

/* Evaluate programs k = 0..n-1 (data[off[k]:off[k]+len[k]], CIE cies[cie[k]])
 * into rows, end to end: first[k], count[k] (-1 where program k is not plain:
 * Python's). rows holds sum(len) + n entries. Returns the number of rows. */
int64_t lp_cfi_eval(const uint8_t *data, const int64_t *off, const int64_t *len,
                    const int32_t *cie, int64_t n, const cie_t *cies, row_t *rows,
                    int64_t *first, int64_t *count)
{
    int64_t pos = 0, used;
    for (int64_t k = 0; k < n; k++) {
        int64_t c;
        first[k] = pos;
        if (evaluate(data + off[k], len[k], &cies[cie[k]], rows + pos, &c, &used) != CFI_OK) {
            count[k] = -1;
            continue;
        }
        count[k] = c;
        pos += c;
    }
    return pos;
}

static int same_rows(const row_t *a, int64_t na, const row_t *b, int64_t nb)
{
    /* _same_rows: both merged (a row whose state equals the previous kept one
     * dropped), then equal location for location, state for state */
    int64_t i = 0, j = 0;
    const row_t *pa = NULL, *pb = NULL;
    for (;;) {
        while (i < na && pa && same_state(pa, &a[i])) i++;
        while (j < nb && pb && same_state(pb, &b[j])) j++;
        if (i == na || j == nb) return i == na && j == nb;
        if (a[i].loc != b[j].loc || !same_state(&a[i], &b[j])) return 0;
        pa = &a[i++];
        pb = &b[j++];
    }
}

/* eh_frame_split._compact of programs k = 0..n-1 (as lp_cfi_eval): out
 * (sum(len) bytes) receives each compacted program at out_off[k], out_len[k];
 * status[k] is 0, or 1 where the program is not plain (Python compacts it). */
int lp_cfi_compact(const uint8_t *data, const int64_t *off, const int64_t *len,
                   const int32_t *cie, int64_t n, const cie_t *cies, uint8_t *out,
                   int64_t *out_off, int64_t *out_len, int8_t *status)
{
    int64_t most = 0, pos = 0;
    for (int64_t k = 0; k < n; k++) if (len[k] > most) most = len[k];
    row_t *rows = malloc(sizeof(row_t) * (most + 1));
    row_t *merged = malloc(sizeof(row_t) * (most + 1));
    row_t *again = NULL;
    int64_t again_cap = 0;
    buf_t canon = {0};
    if (!rows || !merged) { free(rows); free(merged); return -1; }
    for (int64_t k = 0; k < n; k++) {
        const uint8_t *prog = data + off[k];
        const cie_t *c = &cies[cie[k]];
        int64_t nr, used, na, u2;
        status[k] = 1;
        out_off[k] = pos;
        out_len[k] = 0;
        if (evaluate(prog, len[k], c, rows, &nr, &used) != CFI_OK) continue;
        memcpy(merged, rows, sizeof(row_t) * nr);
        canon.n = 0;
        if (write_program(merged, nr, c, &canon) != CFI_OK || canon.bad) continue;
        const uint8_t *keep = prog;
        int64_t keep_len = used;
        if (canon.n < used) {
            if (canon.n + 1 > again_cap) {
                free(again);
                again_cap = canon.n + 1;
                again = malloc(sizeof(row_t) * again_cap);
                if (!again) { again_cap = 0; continue; }
            }
            if (evaluate(canon.p, canon.n, c, again, &na, &u2) != CFI_OK) continue;
            if (same_rows(again, na, rows, nr)) { keep = canon.p; keep_len = canon.n; }
        }
        memcpy(out + pos, keep, keep_len);
        out_len[k] = keep_len;
        pos += keep_len;
        status[k] = 0;
    }
    free(rows);
    free(merged);
    free(again);
    free(canon.p);
    return 0;
}

/* Python's bisect_right (right) or bisect_left over the rows' locations */
static int64_t bisect(const row_t *rows, int64_t n, int64_t x, int right)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (rows[mid].loc < x || (right && rows[mid].loc == x)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* write_program(rows_for_pieces(rows, pieces)): pieces are npieces rows of
 * (new offset, old offset, old length, copied, state offset). The program goes
 * to *out (malloc'ed; lp_cfi_free it); returns its length, or -1 (Python's). */
int64_t lp_cfi_pieces(const row_t *rows, int64_t nrows, const int64_t *pieces,
                      int64_t npieces, const cie_t *cie, uint8_t **out)
{
    buf_t o = {0};
    int64_t m = 0, most = npieces + 1;
    *out = NULL;
    if (!nrows) return -1;
    for (int64_t p = 0; p < npieces; p++)       /* rows inside copied pieces (bounded) */
        if (pieces[5 * p + 3]) most += nrows;
    if (most > npieces + 1 + 4 * nrows) {          /* many copied pieces: count them exactly */
        most = npieces + 1;
        for (int64_t p = 0; p < npieces; p++) {
            const int64_t *pc = pieces + 5 * p;
            if (!pc[3]) continue;
            for (int64_t k = 0; k < nrows; k++)
                most += rows[k].loc > pc[1] && rows[k].loc < pc[1] + pc[2];
        }
    }
    row_t *seq = malloc(sizeof(row_t) * most);
    if (!seq) return -1;
    for (int64_t p = 0; p < npieces; p++) {
        const int64_t *pc = pieces + 5 * p;
        int64_t nw = pc[0], old = pc[1], old_len = pc[2], copied = pc[3], at = pc[4];
        /* state_at(at): the last row at or before it (the first row before all) */
        int64_t lo = bisect(rows, nrows, at, 1);
        seq[m] = rows[lo > 0 ? lo - 1 : 0];
        seq[m++].loc = nw;
        if (copied) {
            int64_t a = bisect(rows, nrows, old, 1), e = bisect(rows, nrows, old + old_len, 0);
            for (int64_t k = a; k < e; k++) {
                seq[m] = rows[k];
                seq[m++].loc = nw + rows[k].loc - old;
            }
        }
    }
    int rc = write_program(seq, m, cie, &o);
    free(seq);
    if (rc != CFI_OK || o.bad) { free(o.p); return -1; }
    *out = o.p;
    return o.n;
}

void lp_cfi_free(void *p)
{
    free(p);
}

int64_t lp_cfi_row_size(void)
{
    return (int64_t)sizeof(row_t);
}
