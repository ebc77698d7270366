/*
 * replay.c - linepack's what-if L1i replay core (compiled at run time by
 * linepack.evaluate.cachemodel, loaded with ctypes).
 *
 * The same model as the TCG plugin (tools/profile/plugin/linepack_plugin.c):
 * set-associative LRU, tags ordered MRU first per set, sets a power of two,
 * set index = line & (sets - 1).  Each executed block replays its list of
 * distinct cache lines (consecutive repeats merged); a block whose first line
 * is the line where the previous block ended does not fetch it again.
 *
 * State (tags, last line) lives in caller-owned arrays so a replay can be
 * split in phases (warm-up without counting, then the measured window).
 */
#include <stdint.h>
#include <string.h>

#define NO_LINE UINT64_MAX

static inline int access_line(uint64_t *tags, uint64_t set_mask, uint32_t ways, uint64_t line)
{
    uint64_t *set = tags + (line & set_mask) * ways;
    uint32_t i;
    if (set[0] == line) {
        return 0;
    }
    for (i = 1; i < ways; i++) {
        if (set[i] == line) {
            memmove(set + 1, set, i * sizeof(*set));
            set[0] = line;
            return 0;
        }
    }
    memmove(set + 1, set, (ways - 1) * sizeof(*set));
    set[0] = line;
    return 1;
}

/*
 * ids[0..n): executed blocks (indices into the block table).
 * off[b], cnt[b]: block b's lines are lines[off[b] .. off[b] + cnt[b]).
 * state[0] = last line (in/out).  totals[0..2) += fetches, misses when count.
 * blk_fetches/blk_misses (may be NULL): per-block sums when count.
 * Returns 0, or -1 on a block with no lines.
 */
int lp_replay(const uint32_t *ids, int64_t n, const int64_t *off, const uint32_t *cnt,
              const uint64_t *lines, uint64_t sets, uint32_t ways, uint64_t *tags,
              uint64_t *state, int count, uint64_t *totals, uint64_t *blk_fetches,
              uint64_t *blk_misses)
{
    uint64_t set_mask = sets - 1, last = state[0], tf = 0, tm = 0;
    int64_t k;
    for (k = 0; k < n; k++) {
        uint32_t b = ids[k], c = cnt[b], i;
        const uint64_t *l = lines + off[b];
        uint64_t m = 0;
        if (c == 0) {
            state[0] = last;
            return -1;
        }
        i = l[0] == last ? 1 : 0;
        for (uint32_t j = i; j < c; j++) {
            m += access_line(tags, set_mask, ways, l[j]);
        }
        last = l[c - 1];
        if (count) {
            tf += c - i;
            tm += m;
            if (blk_fetches) {
                blk_fetches[b] += c - i;
                blk_misses[b] += m;
            }
        }
    }
    state[0] = last;
    totals[0] += tf;
    totals[1] += tm;
    return 0;
}
