/* The hot part's size of one split function for a hot block order, in C
 * (relayout/blocks.py hot_part_size: what build_parts(..., hot_only=True) builds
 * and _relax_parts relaxes, without a Piece object per piece).
 *
 * keep_small_cold sizes the hot part for every small cold block it tries at
 * every place; in Python each try built and relaxed all the function's pieces
 * (SQLite: 3,118 tries, most of the rewrite's time). The same pieces, the same
 * fixpoint, step for step: blocks.py falls back to build_parts when this cannot
 * be built, and tests/test_keep_small_cold.py compares the two on real functions.
 *
 * Per block b of the function (0..nb-1, relative to its first block):
 * copy_len[b]: bytes copied before its terminator (the whole block when the
 * terminator is not re-encoded); kind[b]: 0 nothing re-encoded, 1 static-key
 * site, 2 jmp, 3 jcc; tb[b]: the re-encoded branch's target block; trail[b]:
 * bytes after the branch (int3 padding, copied); flags[b]: bit 0 the branch
 * ends the block, bit 1 jrcxz (no long form), bit 2 a 7x/0F jcc (invertible),
 * bit 3 the block falls through. part[b]: 0 in the hot order, 1 cold, 2 neither.
 * Returns the size, -1 where build_parts gives None (a jrcxz in the hot part),
 * -2 where it would fail (a block in neither part), -3 out of memory. */

#include <stdint.h>
#include <stdlib.h>

enum { P_COPY, P_BRANCH, P_INSERTED, P_REMOVED };
enum { T_NONE, T_KEY, T_JMP, T_JCC };

typedef struct {
    int64_t size, off;
    int32_t block, target;
    int8_t kind, is_long, short_size, long_size, inverted;
} piece;

int64_t lp_hot_part_size(int nb, const int32_t *order, int norder, const int8_t *part,
                         const int64_t *copy_len, const int64_t *trail, const int32_t *tb,
                         const uint8_t *kind, const uint8_t *flags, int short_keys,
                         int invert_jcc)
{
    piece *ps = malloc(sizeof(piece) * (size_t)(4 * norder + 1));
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(nb + 1));
    int64_t total = 0;
    int n = 0, k;
    if (!ps || !first) {
        free(ps);
        free(first);
        return -3;
    }
    for (k = 0; k < norder; k++) {
        int b = order[k], nxt = k + 1 < norder ? order[k + 1] : -1;
        int t = kind[b], f = flags[b];
        if (copy_len[b] > 0) {
            piece p = {copy_len[b], 0, b, -1, P_COPY, 0, 0, 0, 0};
            ps[n++] = p;
        }
        if (t != T_NONE) {
            piece p = {0, 0, b, tb[b], P_BRANCH, 0, 2, 5, 0};
            if (t == T_KEY) {
                p.is_long = !short_keys;
            } else if (t == T_JMP) {
                if (tb[b] == nxt && (f & 1))
                    p.kind = P_REMOVED;
            } else {
                if (f & 2) {
                    total = -1;                 /* jrcxz has no long form */
                    goto out;
                }
                p.long_size = 6;
                if (invert_jcc && tb[b] == nxt && (f & 8) && b + 1 < nb && b + 1 != nxt &&
                    (f & 1) && (f & 4)) {
                    p.target = b + 1;
                    p.inverted = 1;
                }
            }
            if (p.kind == P_BRANCH) {
                if (part[p.target] == 2) {
                    total = -2;
                    goto out;
                }
                if (part[p.target] != 0)
                    p.is_long = 1;
            }
            ps[n++] = p;
            if (trail[b] > 0) {
                piece c = {trail[b], 0, b, -1, P_COPY, 0, 0, 0, 0};
                ps[n++] = c;
            }
        }
        if ((f & 8) && b + 1 < nb && b + 1 != nxt && !(n && ps[n - 1].inverted)) {
            piece p = {0, 0, b, b + 1, P_INSERTED, 0, 2, 5, 0};
            if (part[b + 1] == 2) {
                total = -2;
                goto out;
            }
            p.is_long = part[b + 1] != 0;
            ps[n++] = p;
        }
    }
    for (;;) {
        int changed = 0, i;
        int64_t off = 0;
        for (i = 0; i < nb; i++)
            first[i] = -1;
        for (i = 0; i < n; i++) {
            piece *p = &ps[i];
            if (p->kind == P_BRANCH || p->kind == P_INSERTED)
                p->size = p->is_long ? p->long_size : p->short_size;
            else if (p->kind == P_REMOVED)
                p->size = 0;
            p->off = off;
            if (first[p->block] < 0)
                first[p->block] = off;
            off += p->size;
        }
        total = off;
        for (i = 0; i < n; i++) {
            piece *p = &ps[i];
            int64_t d;
            if ((p->kind != P_BRANCH && p->kind != P_INSERTED) || p->is_long)
                continue;
            if (part[p->target] != 0) {
                p->is_long = changed = 1;
                continue;
            }
            if (first[p->target] < 0) {
                total = -2;
                goto out;
            }
            d = first[p->target] - (p->off + p->size);
            if (d < -128 || d > 127)
                p->is_long = changed = 1;
        }
        if (!changed)
            break;
    }
out:
    free(ps);
    free(first);
    return total;
}
