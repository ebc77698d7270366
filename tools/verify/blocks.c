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

enum { OK = 0, FULL = 2 };
enum { BATCH = 1024 };
/* per instruction: no piece (Python reports it); passes, no edge counted; passes,
 * its fall-through edge counted; passes, Python checks its fall-through; Python
 * checks all of it */
enum { ST_LOST = 0, ST_DONE = 1, ST_DONE_EDGE = 2, ST_FALL = 3, ST_SLOW = 4 };
enum { KIND_COPIED = 0 };

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
    static const char *const names[] = {"jmp", "ret", "retf", "iret", "iretq", "int3", "hlt",
                                        "sysret", "sysretq", "ljmp", 0};
    for (int k = 0; names[k]; k++)
        if (!strcmp(m, names[k])) return 1;
    return 0;
}

/* NEW's bytes at [addr, addr + n) as ElfImage.read gives them (the first
 * allocated section in header order holding addr, file-backed, the range
 * inside it), or NULL */
static const uint8_t *new_bytes(const uint8_t *data, const uint64_t *sec_lo,
                                const uint64_t *sec_hi, const int64_t *sec_off,
                                const uint8_t *sec_file, int64_t nsec, uint64_t addr, uint64_t n)
{
    for (int64_t k = 0; k < nsec; k++) {
        if (sec_lo[k] <= addr && addr < sec_hi[k]) {
            if (!sec_file[k] || addr + n > sec_hi[k]) return 0;
            return data + sec_off[k] + (int64_t)(addr - sec_lo[k]);
        }
    }
    return 0;
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
 * ``counts``: {instructions passed here, edges counted here, text bytes}: the
 * mnemonic and operand text of every instruction left to Python (state
 * ST_FALL or ST_SLOW) go to ``otext``, one "mnemonic\top_str\n" line each, in
 * order (what Capstone's lite decode gives Python). Returns FULL when
 * the output arrays cannot hold the next batch (nothing is kept: call again
 * with larger ones), else OK. */
int lp_block_scan(void *dis_p, void *free_p, size_t handle, int64_t stride, int64_t off_addr,
                  int64_t off_size, int64_t off_mnemonic, int64_t off_op_str,
                  const uint8_t *code, const int64_t *code_off, const uint64_t *fstart,
                  const int64_t *flen, int64_t nfunc,
                  const uint64_t *p_old, const uint64_t *p_end, const uint64_t *p_new,
                  const uint64_t *p_newlen, const int64_t *p_kind, const uint64_t *p_endnew,
                  int64_t npieces,
                  const uint8_t *new_data, const uint64_t *sec_lo, const uint64_t *sec_hi,
                  const int64_t *sec_off, const uint8_t *sec_file, int64_t nsec,
                  const uint64_t *moved, int64_t nmoved, const uint64_t *nofall, int64_t nnofall,
                  uint64_t *oaddr, uint8_t *osize, int64_t *opiece, int8_t *ostate, int64_t cap,
                  char *otext, int64_t tcap, int64_t *ffirst, uint8_t *fstuck, int64_t *counts)
{
    disasm_fn dis = (disasm_fn)dis_p;
    free_fn fr = (free_fn)free_p;
    int64_t n = 0, t = 0;
    counts[0] = counts[1] = counts[2] = 0;
    for (int64_t f = 0; f < nfunc; f++) {
        const uint8_t *fc = code + code_off[f];
        uint64_t fs = fstart[f], fe = fstart[f] + (uint64_t)flen[f];
        int64_t first = n, pos = 0, passed = counts[0], edges = counts[1], text = t;
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
                    return FULL;
                }
                memcpy(otext + t, mn, lm);
                otext[t + lm] = '\t';
                memcpy(otext + t + lm + 1, ops, lo);
                otext[t + lm + 1 + lo] = '\n';
                t += (int64_t)(lm + lo + 2);    /* taken back below where C passes it */
                if (p_kind[p] != KIND_COPIED || succ > p_end[p] || maybe_branch(mn) ||
                    strstr(ops, "rip"))
                    continue;
                /* the piece's bytes: OLD's from this function only (else Python) */
                uint64_t plen = p_end[p] - p_old[p];
                if (p_old[p] < fs || p_end[p] > fe || p_newlen[p] != plen)
                    continue;
                const uint8_t *nb = new_bytes(new_data, sec_lo, sec_hi, sec_off, sec_file, nsec,
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
                t = text;
                break;
            }
        }
    }
    ffirst[nfunc] = n;
    counts[2] = t;
    return OK;
}
