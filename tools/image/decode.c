/* linepack: decode many code ranges with Capstone, straight into arrays.
 *
 * The Python loop around cs_disasm cost about twice the decoding itself (a
 * ctypes call, a copy of ~250-byte cs_insn records and a few numpy arrays per
 * function). Here one call walks every range: cs_disasm (reached through the
 * function pointers Python's capstone module already loaded, so no Capstone
 * header is needed: the cs_insn field offsets come from Python too), and each
 * instruction's address, length and bytes (zero-padded to 16) go to the output
 * arrays.
 *
 * cs_disasm is asked for at most BATCH instructions a call: asked for a whole
 * range it builds one cs_insn array for all of them (about 240 bytes each, grown
 * by realloc), and a large function's array, once freed, stays in the heap:
 * zstd's verify held 11 MiB more than its rows for it.
 *
 * It stops where Capstone stops before a range's end (bytes it rejects: the
 * caller decides what they are) and when the output arrays are full; `state`
 * says where: {range, position in it, rows written}.
 */
#include <stdint.h>
#include <string.h>

typedef size_t (*disasm_fn)(size_t handle, const uint8_t *code, size_t size, uint64_t address,
                            size_t count, void **insn);
typedef void (*free_fn)(void *insn, size_t count);

enum { DONE = 0, STUCK = 1, FULL = 2 };
enum { BATCH = 1024 };

int lp_decode(void *dis_p, void *free_p, size_t handle, const uint8_t *code,
              const int64_t *code_off, const uint64_t *start, const int64_t *len,
              int64_t nranges, int64_t *state, uint64_t *oaddr, uint8_t *osize, int32_t *ofunc,
              uint8_t *oraw, int64_t cap, int64_t first_index, int64_t stride,
              int64_t off_addr, int64_t off_size, int64_t off_bytes)
{
    disasm_fn dis = (disasm_fn)dis_p;
    free_fn fr = (free_fn)free_p;
    int64_t k = state[0], pos = state[1], n = state[2];
    for (; k < nranges; k++, pos = 0) {
        while (pos < len[k]) {
            void *insn = 0;
            size_t count = dis(handle, code + code_off[k] + pos, (size_t)(len[k] - pos),
                               start[k] + (uint64_t)pos, BATCH, &insn);
            if (n + (int64_t)count > cap) {
                if (count) fr(insn, count);
                state[0] = k; state[1] = pos; state[2] = n;
                return FULL;
            }
            const uint8_t *p = (const uint8_t *)insn;
            for (size_t j = 0; j < count; j++, p += stride, n++) {
                uint16_t sz;
                memcpy(&oaddr[n], p + off_addr, 8);
                memcpy(&sz, p + off_size, 2);
                osize[n] = (uint8_t)sz;
                ofunc[n] = (int32_t)(first_index + k);
                /* the instruction's bytes only: Capstone leaves stale heap bytes
                   after them in cs_insn.bytes (the rest of the row stays zero) */
                memcpy(oraw + 16 * n, p + off_bytes, sz < 16 ? sz : 16);
                pos += sz;
            }
            if (count) fr(insn, count);
            if (count == BATCH)
                continue;           /* a full batch: the range goes on */
            if (pos < len[k]) {
                state[0] = k; state[1] = pos; state[2] = n;
                return STUCK;
            }
        }
    }
    state[0] = k; state[1] = 0; state[2] = n;
    return DONE;
}
