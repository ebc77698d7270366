/* linepack verify: the block check's common instruction, decided in C.
 *
 * verify/blocks.py walks every original instruction of the split functions.
 * Most are copied instructions that NEW holds unchanged at their place in the
 * piece, that neither branch nor address relative to RIP nor hold a moved data
 * field: they have the same meaning without a decode, and most fall through
 * to the next byte of the piece. Here one call decodes the split functions'
 * original bytes (Capstone without detail, reached through the function
 * pointers Python's capstone module loaded, as image/decode.c does), finds
 * each instruction's piece and decides exactly that common case, with the
 * same tests as the Python loop (mnemonic and operand text, the bytes of OLD
 * and NEW, the piece columns). Everything else, and every function Capstone
 * stops inside, is left to the Python loop, which checks it in full: C only
 * ever says "this instruction passes the way the Python fast path passes it".
 *
 * Nothing here comes from relayout: the pieces are the block map's rows, the
 * bytes are the two images'.
 */
#include <stdint.h>
#include <string.h>

typedef size_t (*disasm_fn)(size_t handle, const uint8_t *code, size_t size, uint64_t address,
                            size_t count, void **insn);
typedef void (*free_fn)(void *insn, size_t count);

enum { OK = 0, FULL = 2, TEXT_FULL = 3 };
enum { BATCH = 1024 };
/* per instruction: no piece (Python reports it); passes, no edge counted; passes,
 * its fall-through edge counted; passes, Python checks its fall-through; Python
 * checks all of it; a plain branch that passes, Python checks its fall-through
 * (with its target) */
enum { ST_LOST = 0, ST_DONE = 1, ST_DONE_EDGE = 2, ST_FALL = 3, ST_SLOW = 4,
       ST_BRANCH_FALL = 5 };
enum { KIND_COPIED = 0, KIND_BRANCH = 1 };

/* the greatest index i with v[i] <= x, or -1 */
static int64_t last_le(const uint64_t *v, int64_t n, uint64_t x)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (v[mid] <= x) lo = mid + 1; else hi = mid;
    }
    return lo - 1;
}

/* the least index i with v[i] >= x (n if none) */
static int64_t first_ge(const uint64_t *v, int64_t n, uint64_t x)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (v[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* blocks.py _maybe_branch: a whitespace-separated word of the mnemonic starts
 * with 'j' or "loop", or is call, lcall or xbegin */
static int maybe_branch(const char *m)
{
    const char *p = m;
    while (*p) {
        while (*p == ' ' || *p == '\t') p++;
        if (!*p) break;
        const char *w = p;
        while (*p && *p != ' ' && *p != '\t') p++;
        size_t n = (size_t)(p - w);
        if (w[0] == 'j' || (n >= 4 && !strncmp(w, "loop", 4)) ||
            (n == 4 && !strncmp(w, "call", 4)) || (n == 5 && !strncmp(w, "lcall", 5)) ||
            (n == 6 && !strncmp(w, "xbegin", 6)))
            return 1;
    }
    return 0;
}

/* blocks.py _NO_FALLTHROUGH */
static int no_fallthrough_mnemonic(const char *m)
{
    static const char *const names[] = {"jmp", "ret", "retf", "iret", "iretq", "int3",
                                        "sysret", "sysretq", "ljmp", 0};   /* not hlt */
    for (int k = 0; names[k]; k++)
        if (!strcmp(m, names[k])) return 1;
    return 0;
}

/* NEW's bytes at [addr, addr + n) as ElfImage.read gives them (the first
 * allocated section in header order holding addr, file-backed, the range
 * inside it), or NULL. ``sec_base``[k]: where section k's bytes are in memory
 * (the mapped file, or the mutation test's copy of a patched section) */
static const uint8_t *new_bytes(const uint64_t *sec_lo, const uint64_t *sec_hi,
                                const uint64_t *sec_base, const uint8_t *sec_file, int64_t nsec,
                                uint64_t addr, uint64_t n)
{
    for (int64_t k = 0; k < nsec; k++) {
        if (sec_lo[k] <= addr && addr < sec_hi[k]) {
            if (!sec_file[k] || n > sec_hi[k] - addr) return 0;     /* no wrap-around */
            return (const uint8_t *)(uintptr_t)sec_base[k] + (addr - sec_lo[k]);
        }
    }
    return 0;
}

/* blocks.py _plain_branch: opcode length of a direct call/jmp/jcc without
 * prefixes (E8/E9 rel32, EB/7x rel8, 0F 8x rel32) of exactly ``n`` bytes, else 0 */
static int plain_op(const uint8_t *b, int n)
{
    if (n == 5 && (b[0] == 0xE8 || b[0] == 0xE9)) return 1;
    if (n == 2 && (b[0] == 0xEB || (b[0] >= 0x70 && b[0] <= 0x7F))) return 1;
    if (n == 6 && b[0] == 0x0F && b[1] >= 0x80 && b[1] <= 0x8F) return 2;
    return 0;
}

static int64_t rel_at(const uint8_t *b, int op, int n)
{
    if (n - op == 1) return (int8_t)b[op];
    int32_t v;
    memcpy(&v, b + op, 4);
    return v;
}

/* blocks.py _plain_form's (kind, condition, length): kind 1 call, 2 jmp, 3 jcc;
 * 0 when ``code`` (``n`` bytes readable) starts with no plain branch */
static int plain_form(const uint8_t *c, int n, int *cond, int *len, int *op)
{
    *cond = -1;
    if (n >= 5 && (c[0] == 0xE8 || c[0] == 0xE9)) { *len = 5; *op = 1; return c[0] == 0xE8 ? 1 : 2; }
    if (n >= 2 && c[0] == 0xEB) { *len = 2; *op = 1; return 2; }
    if (n >= 2 && c[0] >= 0x70 && c[0] <= 0x7F) { *len = 2; *op = 1; *cond = c[0] & 0xF; return 3; }
    if (n >= 6 && c[0] == 0x0F && c[1] >= 0x80 && c[1] <= 0x8F) {
        *len = 6; *op = 2; *cond = c[1] & 0xF; return 3;
    }
    return 0;
}

struct maps {
    const uint64_t *p_old, *p_end, *p_new, *p_newlen;
    const int64_t *p_kind;
    int64_t npieces;
    int64_t outside;                    /* FunctionMap.map1 below, else 0 */
    const uint64_t *o_start, *o_end, *n_start, *l_old, *l_new, *l_end, *fixed;
    int64_t nfun, nlab, nfixed;
};

/* BlockMap.map1: through the pieces, else FunctionMap.map1 (the function-level map
 * of everything else); 0 in *ok where neither answers here (Python's then) */
static uint64_t map1(const struct maps *m, uint64_t a, int *ok)
{
    int64_t i = last_le(m->p_old, m->npieces, a);
    *ok = 1;
    if (i >= 0 && a < m->p_end[i])
        return m->p_kind[i] != KIND_COPIED ? m->p_new[i] : m->p_new[i] + (a - m->p_old[i]);
    if (!m->outside || !m->nfun) { *ok = 0; return 0; }
    i = last_le(m->o_start, m->nfun, a);
    int64_t ic = i > 0 ? i : 0;
    int inside = i >= 0 && a <= m->o_end[ic];
    uint64_t out = inside ? a + m->n_start[ic] - m->o_start[ic] : a;
    if (m->nlab) {
        int64_t j = last_le(m->l_old, m->nlab, a);
        int64_t jc = j > 0 ? j : 0;
        if (!inside && j >= 0 && a < m->l_end[jc])
            out = a + m->l_new[jc] - m->l_old[jc];
    }
    if (m->nfixed) {
        int64_t k = last_le(m->fixed, m->nfixed, a);
        if (k >= 0 && m->fixed[k] == a && !(inside && a == m->o_start[ic]))
            out = a;
    }
    return out;
}

static int member(const uint64_t *v, int64_t n, uint64_t x)
{
    int64_t k = n ? last_le(v, n, x) : -1;
    return k >= 0 && v[k] == x;
}

/* A plain branch (blocks.py _plain_branch) in a copied piece, the same opcode at its
 * place in NEW with the translated target (_same_plain_branch), or a re-encoded one
 * in its own piece, the same kind and condition of the map's length to the
 * translated target (_same_plain_relaxed): ST_DONE / ST_DONE_EDGE as the Python loop
 * counts it (its fall-through edge reaching the translated successor), ST_BRANCH_FALL
 * where Python must check that edge; ST_SLOW for anything else (Python decides). */
static int plain_branch_state(const struct maps *m, int64_t p, uint64_t a, int sz,
                              const uint8_t *ob, uint64_t fs, uint64_t fe, const char *mn,
                              const uint64_t *sec_lo,
                              const uint64_t *sec_hi, const uint64_t *sec_base,
                              const uint8_t *sec_file, int64_t nsec,
                              const uint64_t *moved, int64_t nmoved,
                              const uint64_t *nofall, int64_t nnofall,
                              const uint64_t *noreturn, int64_t nnoreturn, int64_t *counts)
{
    (void)fs; (void)mn;
    int op = plain_op(ob, sz);
    if (!op)
        return ST_SLOW;
    uint64_t target = a + (uint64_t)sz + (uint64_t)rel_at(ob, op, sz);
    uint64_t succ = a + (uint64_t)sz, n_end;
    int ok;
    if (m->p_kind[p] == KIND_COPIED) {
        if (nmoved) {                       /* a moved data field: Python's translate */
            int64_t k = first_ge(moved, nmoved, a);
            if (k < nmoved && moved[k] < succ) return ST_SLOW;
        }
        uint64_t nn = m->p_new[p] + (a - m->p_old[p]);
        const uint8_t *nb = new_bytes(sec_lo, sec_hi, sec_base, sec_file, nsec, nn,
                                      (uint64_t)sz);
        if (!nb || memcmp(nb, ob, (size_t)op)) return ST_SLOW;
        uint64_t want = map1(m, target, &ok);
        if (!ok || nn + (uint64_t)sz + (uint64_t)rel_at(nb, op, sz) != want) return ST_SLOW;
        n_end = nn + (uint64_t)sz;
    } else if (m->p_kind[p] == KIND_BRANCH) {
        if (m->p_old[p] != a || m->p_end[p] != succ) return ST_SLOW;
        uint64_t nn = m->p_new[p];
        int64_t nl = (int64_t)m->p_newlen[p];
        const uint8_t *nb = nl > 0 ? new_bytes(sec_lo, sec_hi, sec_base, sec_file,
                                               nsec, nn, (uint64_t)nl) : 0;
        if (!nb) return ST_SLOW;
        int oc, olen, oop, nc, nlen, nop;
        int ok_kind = plain_form(ob, sz, &oc, &olen, &oop);
        int nk_kind = plain_form(nb, (int)nl, &nc, &nlen, &nop);
        if (!ok_kind || !nk_kind || ok_kind != nk_kind || oc != nc || nlen != nl)
            return ST_SLOW;
        uint64_t want = map1(m, target, &ok);
        if (!ok || nn + (uint64_t)nl + (uint64_t)rel_at(nb, nop, (int)nl) != want)
            return ST_SLOW;
        n_end = nn + (uint64_t)nl;
        counts[3]++;
    } else {
        return ST_SLOW;
    }
    counts[0]++;
    /* blocks.py fall_edge: jmp never falls through, a call to a noreturn target neither */
    int is_jmp = ob[0] == 0xE9 || ob[0] == 0xEB, is_call = ob[0] == 0xE8;
    int falls = !is_jmp && !member(nofall, nnofall, a) &&
                !(is_call && member(noreturn, nnoreturn, target));
    if (!falls || succ >= fe)
        return ST_DONE;
    uint64_t want = map1(m, succ, &ok);
    if (ok && want == n_end) {
        counts[1]++;
        return ST_DONE_EDGE;
    }
    return ST_BRANCH_FALL;
}

/* Where Capstone's detail of an x86 instruction keeps what image/operands.py reads */
struct detail_at {
    int64_t handle;                     /* a Capstone handle with details on */
    int64_t insn_detail;                /* cs_insn.detail */
    int64_t op_count, operands, op_size, op_type, op_mem_base, disp_offset;
    int64_t op_mem, reg_rip;            /* X86_OP_MEM, X86_REG_RIP */
};

/* image/operands.py rip_relative for one instruction's bytes alone (decoded at 0):
 * the offset of its displacement when it has a RIP-based memory operand, else 0;
 * -1 where the batch would not decode it in step (Python asks then) */
static int rip_disp(disasm_fn dis, free_fn fr, const struct detail_at *dt, const uint8_t *b,
                    int sz, int64_t off_size)
{
    void *insn = 0;
    size_t count = dis((size_t)dt->handle, b, (size_t)sz, 0, 1, &insn);
    if (count != 1) {
        if (count) fr(insn, count);
        return -1;
    }
    uint16_t got;
    memcpy(&got, (const uint8_t *)insn + off_size, 2);
    const uint8_t *d;
    memcpy(&d, (const uint8_t *)insn + dt->insn_detail, sizeof d);
    int res = -1;
    if (got == sz && d) {
        int rip = 0;
        uint8_t nops = d[dt->op_count];
        for (int j = 0; j < 8 && j < nops; j++) {
            uint32_t typ, base;
            const uint8_t *o = d + dt->operands + j * dt->op_size;
            memcpy(&typ, o + dt->op_type, 4);
            memcpy(&base, o + dt->op_mem_base, 4);
            if (typ == (uint32_t)dt->op_mem && base == (uint32_t)dt->reg_rip) rip = 1;
        }
        res = rip ? d[dt->disp_offset] : 0;
    }
    fr(insn, count);
    return res;
}

static uint64_t sext32(const uint8_t *b)
{
    int32_t v;
    memcpy(&v, b, 4);
    return (uint64_t)(int64_t)v;
}

/* A copied RIP-relative instruction (no branch) whose bytes in NEW differ from
 * OLD's at most in the displacement, which designates the translated target
 * (blocks.py _same_rip_relative): ST_DONE / ST_DONE_EDGE / ST_FALL as the
 * Python loop goes on with it; ST_SLOW for anything else. */
static int rip_state(disasm_fn dis, free_fn fr, const struct detail_at *dt,
                     const struct maps *m, int64_t p, uint64_t a, int sz, const uint8_t *ob,
                     uint64_t fe, const char *mn,
                     const uint64_t *sec_lo, const uint64_t *sec_hi, const uint64_t *sec_base,
                     const uint8_t *sec_file, int64_t nsec, const uint64_t *moved,
                     int64_t nmoved, const uint64_t *nofall, int64_t nnofall, int64_t off_size,
                     int64_t *counts)
{
    uint64_t succ = a + (uint64_t)sz;
    if (nmoved) {                           /* a moved data field: Python's translate */
        int64_t k = first_ge(moved, nmoved, a);
        if (k < nmoved && moved[k] < succ) return ST_SLOW;
    }
    int d = rip_disp(dis, fr, dt, ob, sz, off_size);
    if (d <= 0 || d + 4 > sz) return ST_SLOW;
    uint64_t nn = m->p_new[p] + (a - m->p_old[p]);
    const uint8_t *nb = new_bytes(sec_lo, sec_hi, sec_base, sec_file, nsec, nn,
                                  (uint64_t)sz);
    if (!nb || memcmp(nb, ob, (size_t)d) || memcmp(nb + d + 4, ob + d + 4, (size_t)(sz - d - 4)))
        return ST_SLOW;
    int ok;
    uint64_t want = map1(m, a + (uint64_t)sz + sext32(ob + d), &ok);
    if (!ok || nn + (uint64_t)sz + sext32(nb + d) != want) return ST_SLOW;
    counts[0]++;
    uint64_t n_end = nn + (uint64_t)sz;
    if (no_fallthrough_mnemonic(mn) || member(nofall, nnofall, a) || succ >= fe)
        return ST_DONE;
    uint64_t next = map1(m, succ, &ok);
    if (ok && next == n_end) {
        counts[1]++;
        return ST_DONE_EDGE;
    }
    return ST_FALL;
}

/* Decode functions (their bytes end to end in ``code`` at ``code_off``, from
 * ``fstart``, ``flen`` bytes each) and decide each instruction's state.
 *
 * Pieces (sorted by original start): p_old, p_end (original range), p_new,
 * p_newlen, p_kind, p_endnew (where the piece's end maps). ``moved``: sorted
 * original addresses of fields whose data moved; ``nofall``: sorted original
 * addresses that never fall through. Out per instruction: address, length,
 * piece, state; ``ffirst``[f]..``ffirst``[f+1]: function f's rows,
 * ``fstuck``[f]: Capstone stopped inside it (no rows; Python decodes it).
 * ``counts``: {instructions passed here, edges counted here, text bytes, re-encoded
 * branches passed here}: the
 * mnemonic and operand text of every instruction left to Python (state
 * ST_FALL or ST_SLOW) go to ``otext``, one "mnemonic\top_str\n" line each, in
 * order (what Capstone's lite decode gives Python). Returns FULL when
 * the output arrays cannot hold the next batch, TEXT_FULL when ``otext`` cannot
 * hold the next line (nothing is kept: call again with larger ones), else OK. */
int lp_block_scan(void *dis_p, void *free_p, size_t handle, int64_t stride, int64_t off_addr,
                  int64_t off_size, int64_t off_mnemonic, int64_t off_op_str,
                  const uint8_t *code, const int64_t *code_off, const uint64_t *fstart,
                  const int64_t *flen, int64_t nfunc,
                  const uint64_t *p_old, const uint64_t *p_end, const uint64_t *p_new,
                  const uint64_t *p_newlen, const int64_t *p_kind, const uint64_t *p_endnew,
                  int64_t npieces,
                  const uint64_t *sec_lo, const uint64_t *sec_hi,
                  const uint64_t *sec_base, const uint8_t *sec_file, int64_t nsec,
                  const uint64_t *moved, int64_t nmoved, const uint64_t *nofall, int64_t nnofall,
                  int64_t branches, const uint64_t *noreturn, int64_t nnoreturn,
                  int64_t outside, const uint64_t *o_start, const uint64_t *o_end,
                  const uint64_t *n_start, int64_t nfun, const uint64_t *l_old,
                  const uint64_t *l_new, const uint64_t *l_end, int64_t nlab,
                  const uint64_t *fixed, int64_t nfixed, const int64_t *detail_at,
                  uint64_t *oaddr, uint8_t *osize, int64_t *opiece, int8_t *ostate, int64_t cap,
                  char *otext, int64_t tcap, int64_t *ffirst, uint8_t *fstuck, int64_t *counts)
{
    disasm_fn dis = (disasm_fn)dis_p;
    free_fn fr = (free_fn)free_p;
    int64_t n = 0, t = 0;
    struct detail_at dt;
    memcpy(&dt, detail_at, sizeof dt);
    struct maps m = {p_old, p_end, p_new, p_newlen, p_kind, npieces, outside, o_start, o_end, n_start,
                     l_old, l_new, l_end, fixed, nfun, nlab, nfixed};
    counts[0] = counts[1] = counts[2] = counts[3] = 0;
    for (int64_t f = 0; f < nfunc; f++) {
        const uint8_t *fc = code + code_off[f];
        uint64_t fs = fstart[f], fe = fstart[f] + (uint64_t)flen[f];
        int64_t first = n, pos = 0, passed = counts[0], edges = counts[1], text = t,
                relaxed = counts[3];
        ffirst[f] = n;
        fstuck[f] = 0;
        while (pos < flen[f]) {
            void *insn = 0;
            size_t count = dis(handle, fc + pos, (size_t)(flen[f] - pos), fs + (uint64_t)pos,
                               BATCH, &insn);
            if (n + (int64_t)count > cap) {
                if (count) fr(insn, count);
                return FULL;
            }
            const uint8_t *q = (const uint8_t *)insn;
            for (size_t j = 0; j < count; j++, q += stride, n++) {
                uint64_t a;
                uint16_t sz;
                memcpy(&a, q + off_addr, 8);
                memcpy(&sz, q + off_size, 2);
                const char *mn = (const char *)(q + off_mnemonic);
                const char *ops = (const char *)(q + off_op_str);
                uint64_t succ = a + sz;
                pos += sz;
                oaddr[n] = a;
                osize[n] = (uint8_t)sz;
                int64_t p = last_le(p_old, npieces, a);
                if (p >= 0 && a >= p_end[p]) p = -1;
                opiece[n] = p;
                if (p < 0) { ostate[n] = ST_LOST; continue; }
                ostate[n] = ST_SLOW;
                /* room for this instruction's text, if it needs it */
                size_t lm = strnlen(mn, 32), lo = strnlen(ops, 160);
                if (t + (int64_t)(lm + lo + 2) > tcap) {
                    fr(insn, count);
                    return TEXT_FULL;
                }
                memcpy(otext + t, mn, lm);
                otext[t + lm] = '\t';
                memcpy(otext + t + lm + 1, ops, lo);
                otext[t + lm + 1 + lo] = '\n';
                t += (int64_t)(lm + lo + 2);    /* taken back below where C passes it */
                if (branches) {
                    int st = plain_branch_state(&m, p, a, (int)sz, fc + (a - fs), fs, fe, mn,
                                                sec_lo, sec_hi, sec_base, sec_file, nsec,
                                                moved, nmoved, nofall, nnofall, noreturn,
                                                nnoreturn, counts);
                    if (st != ST_SLOW) {
                        ostate[n] = (int8_t)st;
                        if (st != ST_BRANCH_FALL)
                            t -= (int64_t)(lm + lo + 2);    /* Python needs no text */
                        continue;
                    }
                }
                if (p_kind[p] != KIND_COPIED || succ > p_end[p] || maybe_branch(mn))
                    continue;
                if (strstr(ops, "eip"))
                    continue;               /* EIP-relative (67 prefix): Python decides */
                if (strstr(ops, "rip")) {
                    if (branches) {
                        int st = rip_state(dis, fr, &dt, &m, p, a, (int)sz, fc + (a - fs), fe,
                                           mn, sec_lo, sec_hi, sec_base, sec_file,
                                           nsec, moved, nmoved, nofall, nnofall, off_size,
                                           counts);
                        if (st != ST_SLOW) {
                            ostate[n] = (int8_t)st;
                            if (st != ST_FALL)
                                t -= (int64_t)(lm + lo + 2);
                        }
                    }
                    continue;
                }
                /* the piece's bytes: OLD's from this function only (else Python) */
                uint64_t plen = p_end[p] - p_old[p];
                if (p_old[p] < fs || p_end[p] > fe || p_newlen[p] != plen)
                    continue;
                const uint8_t *nb = new_bytes(sec_lo, sec_hi, sec_base, sec_file, nsec,
                                              p_new[p], plen);
                if (!nb)
                    continue;
                /* unchanged: [a, succ) equal in OLD and at the piece's place in NEW */
                if (memcmp(fc + (a - fs), nb + (a - p_old[p]), sz))
                    continue;
                if (nmoved) {
                    int64_t k = first_ge(moved, nmoved, a);
                    if (k < nmoved && moved[k] < succ) continue;
                }
                uint64_t nn = p_new[p] + (a - p_old[p]);
                counts[0]++;
                t -= (int64_t)(lm + lo + 2);
                if ((succ < p_end[p] && succ < fe) || p_endnew[p] == nn + sz) {
                    int64_t k = nnofall ? last_le(nofall, nnofall, a) : -1;
                    int never = k >= 0 && nofall[k] == a;
                    if (!no_fallthrough_mnemonic(mn) && !never && succ < fe) {
                        ostate[n] = ST_DONE_EDGE;
                        counts[1]++;
                    } else {
                        ostate[n] = ST_DONE;
                    }
                } else {
                    ostate[n] = ST_FALL;
                    t += (int64_t)(lm + lo + 2);    /* Python needs its text */
                }
            }
            if (count) fr(insn, count);
            if (count == BATCH)
                continue;
            if (pos < flen[f]) {            /* Capstone stopped: Python decodes it */
                fstuck[f] = 1;
                n = first;
                counts[0] = passed;
                counts[1] = edges;
                counts[3] = relaxed;
                t = text;
                break;
            }
        }
    }
    ffirst[nfunc] = n;
    counts[2] = t;
    return OK;
}
