/* linepack: reading DWARF bytes (LEB128, little-endian words), abbreviation
 * tables and attribute forms, shared by the DWARF core's C files (info.c,
 * fields.c). Everything is static: each file gets its own copy, inlined. */
#ifndef LINEPACK_DWARF_READ_H
#define LINEPACK_DWARF_READ_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* ---------------------------------------------------------------- bytes */

typedef struct { const uint8_t *b; int64_t n; } sec_t;

static int rd_uleb(const sec_t *s, int64_t *p, uint64_t *v) {
    uint64_t x = 0; int sh = 0;
    for (;;) {
        if (*p < 0 || *p >= s->n) return -1;
        uint8_t c = s->b[(*p)++];
        if (sh < 64) x |= (uint64_t)(c & 0x7f) << sh;
        sh += 7;
        if (!(c & 0x80)) break;
    }
    *v = x; return 0;
}

static int rd_sleb(const sec_t *s, int64_t *p, int64_t *v) {
    uint64_t x = 0; int sh = 0; uint8_t c = 0;
    for (;;) {
        if (*p < 0 || *p >= s->n) return -1;
        c = s->b[(*p)++];
        if (sh < 64) x |= (uint64_t)(c & 0x7f) << sh;
        sh += 7;
        if (!(c & 0x80)) break;
    }
    if (sh < 64 && (c & 0x40)) x |= ~(uint64_t)0 << sh;
    *v = (int64_t)x; return 0;
}

static int rd_le(const sec_t *s, int64_t p, int n, uint64_t *v) {
    if (p < 0 || n < 0 || p + n > s->n) return -1;
    uint64_t x = 0;
    for (int i = 0; i < n && i < 8; i++) x |= (uint64_t)s->b[p + i] << (8 * i);
    *v = x; return 0;
}

/* --------------------------------------------------------- abbreviations */

#define DW_FORM_addr 0x01
#define DW_FORM_indirect 0x16
#define DW_FORM_implicit_const 0x21

typedef struct { uint64_t attr, form; } spec_t;
typedef struct { uint64_t code, tag; int64_t first, n; } abbrev_t;
typedef struct {
    abbrev_t *ab; int64_t nab, capab;
    spec_t *sp; int64_t nsp, capsp;
    int64_t *direct; int64_t ndirect;     /* code -> index + 1 for small codes */
} atab_t;

static void atab_free(atab_t *t) { free(t->ab); free(t->sp); free(t->direct); memset(t, 0, sizeof *t); }

/* Parse the table at ``off``; a later entry with the same code wins (as a dict). */
static int atab_parse(atab_t *t, const sec_t *s, int64_t off) {
    memset(t, 0, sizeof *t);
    int64_t p = off;
    uint64_t maxc = 0;
    for (;;) {
        uint64_t code, tag, at, form;
        if (rd_uleb(s, &p, &code)) return -1;
        if (code == 0) break;
        if (rd_uleb(s, &p, &tag)) return -1;
        if (p >= s->n) return -1;
        p++;                                            /* children */
        if (t->nab == t->capab) {
            t->capab = t->capab ? 2 * t->capab : 256;
            abbrev_t *na = realloc(t->ab, sizeof(abbrev_t) * t->capab);
            if (!na) return -1;
            t->ab = na;
        }
        abbrev_t *a = &t->ab[t->nab++];
        a->code = code; a->tag = tag; a->first = t->nsp; a->n = 0;
        for (;;) {
            if (rd_uleb(s, &p, &at) || rd_uleb(s, &p, &form)) return -1;
            if (form == DW_FORM_implicit_const) {
                int64_t ic; if (rd_sleb(s, &p, &ic)) return -1;
            } else if (at == 0 && form == 0) break;
            if (t->nsp == t->capsp) {
                t->capsp = t->capsp ? 2 * t->capsp : 1024;
                spec_t *ns = realloc(t->sp, sizeof(spec_t) * t->capsp);
                if (!ns) return -1;
                t->sp = ns;
            }
            t->sp[t->nsp].attr = at; t->sp[t->nsp].form = form; t->nsp++; a->n++;
        }
        if (code > maxc) maxc = code;
    }
    t->ndirect = maxc < (1u << 20) ? (int64_t)maxc + 1 : 0;
    if (t->ndirect) {
        t->direct = calloc((size_t)t->ndirect, sizeof(int64_t));
        if (!t->direct) return -1;
        for (int64_t i = 0; i < t->nab; i++) t->direct[t->ab[i].code] = i + 1;
    }
    return 0;
}

static const abbrev_t *atab_get(const atab_t *t, uint64_t code) {
    if (t->ndirect) return code < (uint64_t)t->ndirect && t->direct[code] ? &t->ab[t->direct[code] - 1] : NULL;
    for (int64_t i = t->nab - 1; i >= 0; i--) if (t->ab[i].code == code) return &t->ab[i];
    return NULL;
}

/* Position after a value of ``form`` at ``p`` (encoding.skip_form); -1 truncated, -2 unknown form. */
static int skip_form(const sec_t *s, int64_t *p, uint64_t form, int asz, int osz, int version) {
    uint64_t v;
    int64_t n = -1;
    switch (form) {
    case 0x01: n = asz; break;
    case 0x0e: case 0x17: case 0x1d: case 0x1f: case 0x1f20: case 0x1f21: n = osz; break;
    case 0x10: n = version == 2 ? asz : osz; break;
    case 0x05: case 0x12: case 0x26: case 0x2a: n = 2; break;
    case 0x06: case 0x13: case 0x1c: case 0x28: case 0x2c: n = 4; break;
    case 0x07: case 0x14: case 0x20: case 0x24: n = 8; break;
    case 0x0b: case 0x0c: case 0x11: case 0x25: case 0x29: n = 1; break;
    case 0x27: case 0x2b: n = 3; break;
    case 0x1e: n = 16; break;
    case 0x19: case 0x21: n = 0; break;
    case 0x0d: case 0x0f: case 0x15: case 0x1a: case 0x1b: case 0x22: case 0x23: case 0x1f01: case 0x1f02:
        return rd_uleb(s, p, &v) ? -1 : 0;
    case 0x08: {
        const uint8_t *z = *p >= 0 && *p < s->n ? memchr(s->b + *p, 0, (size_t)(s->n - *p)) : NULL;
        if (!z) return -1;
        *p = z - s->b + 1; return 0;
    }
    case 0x09: case 0x18:
        if (rd_uleb(s, p, &v)) return -1;
        if (v > (uint64_t)(s->n - *p)) return -1;
        *p += (int64_t)v; return 0;
    case 0x0a: if (rd_le(s, *p, 1, &v)) return -1; n = 1 + (int64_t)v; break;
    case 0x03: if (rd_le(s, *p, 2, &v)) return -1; n = 2 + (int64_t)v; break;
    case 0x04: if (rd_le(s, *p, 4, &v)) return -1; n = 4 + (int64_t)v; break;
    default: return -2;
    }
    if (*p + n > s->n) return -1;
    *p += n; return 0;
}

#endif
