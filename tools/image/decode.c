/* linepack: decode many code ranges with Capstone, straight into arrays.
 *
 * The Python loop around cs_disasm cost about twice the decoding itself (a
 * ctypes call, a copy of ~250-byte cs_insn records and a few numpy arrays per
 * function). Here one call walks every range: cs_disasm_iter (reached through
 * the function pointers Python's capstone module already loaded, so no Capstone
 * header is needed: the cs_insn field offsets come from Python too), and each
 * instruction's address, length and bytes (zero-padded to 16) go to the output
 * arrays.
 *
 * Each instruction is decoded by cs_disasm_iter into one cs_insn made once
 * (cs_malloc): cs_disasm builds and frees an array of them per call (about 240
 * bytes each), which cost a tenth of the decoding, and a large array, once
 * freed, stayed in the heap.
 *
 * With `printer_off` >= 0 the handle's text printer (the cs_struct field at that
 * offset, found and checked by decode_core.py) is a no-op for the call: Capstone
 * formats every instruction's mnemonic and operands, about half its time, and
 * nothing here reads them; the rows (address, length, bytes, where it stops) do
 * not depend on the printer. The printer is put back before returning.
 *
 * It stops where Capstone stops before a range's end (bytes it rejects: the
 * caller decides what they are) and when the output arrays are full; `state`
 * says where: {range, position in it, rows written}.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef bool (*iter_fn)(size_t handle, const uint8_t **code, size_t *size, uint64_t *address,
                       void *insn);
typedef void *(*malloc_fn)(size_t handle);
typedef void (*free_fn)(void *insn, size_t count);

enum { DONE = 0, STUCK = 1, FULL = 2, NOMEM = 3 };

/* Capstone's Printer_t: (MCInst *, SStream *, void *info) */
static void quiet_printer(void *mcinst, void *stream, void *info)
{
    (void)mcinst;
    (void)stream;
    (void)info;
}

int lp_decode(void *iter_p, void *malloc_p, void *free_p, size_t handle, const uint8_t *code,
              const int64_t *code_off, const uint64_t *start, const int64_t *len,
              int64_t nranges, int64_t *state, uint64_t *oaddr, uint8_t *osize, int32_t *ofunc,
              uint8_t *oraw, int64_t cap, int64_t first_index,
              int64_t off_addr, int64_t off_size, int64_t off_bytes, int64_t printer_off)
{
    iter_fn next = (iter_fn)iter_p;
    free_fn fr = (free_fn)free_p;
    uint8_t *insn = (uint8_t *)((malloc_fn)malloc_p)(handle);
    int64_t k = state[0], pos = state[1], n = state[2];
    int rc = DONE;
    if (!insn)
        return NOMEM;
    void **printer = printer_off >= 0 ? (void **)((uint8_t *)handle + printer_off) : NULL;
    void *saved = printer ? *printer : NULL;
    if (printer)
        *printer = (void *)quiet_printer;
    for (; k < nranges; k++, pos = 0) {
        const uint8_t *c = code + code_off[k] + pos;
        size_t left = (size_t)(len[k] - pos);
        uint64_t address = start[k] + (uint64_t)pos;
        while (left) {
            if (n >= cap) {
                rc = FULL;
                goto out;
            }
            if (!next(handle, &c, &left, &address, insn)) {
                rc = STUCK;
                goto out;
            }
            uint16_t sz;
            memcpy(&oaddr[n], insn + off_addr, 8);
            memcpy(&sz, insn + off_size, 2);
            osize[n] = (uint8_t)sz;
            ofunc[n] = (int32_t)(first_index + k);
            /* the instruction's bytes only: the cs_insn's buffer holds the previous
               instruction's after them (the rest of the row stays zero) */
            memcpy(oraw + 16 * n, insn + off_bytes, sz < 16 ? sz : 16);
            pos += sz;
            n++;
        }
    }
out:
    state[0] = k; state[1] = k < nranges ? pos : 0; state[2] = n;
    fr(insn, 1);
    if (printer)
        *printer = saved;
    return rc;
}
