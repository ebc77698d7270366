"""``__jump_table``: static-key (jump label) sites.

6.1 entry: ``{s32 code; s32 target; long key}``, each field relative to its
own address; key bit 0 = branch default, bit 1 = init. The kernel decodes the
live bytes at ``code`` to learn the site size and BUG()s unless they are one of
nop2 ``66 90``, nop5 ``0f 1f 44 00 00``, ``eb rel8`` or ``e9 rel32``.
Before 5.14 the patcher wrote 5 bytes only, so a 2-byte site there is fatal.
Unchanged in 6.12 and 7.3 (include/linux/jump_label.h, arch/x86/kernel/jump_label.c).
"""

import numpy as np

from .base import Finding, KernelTable, split_key_flags

NOP2 = bytes.fromhex("6690")
NOP5 = bytes.fromhex("0f1f440000")
KINDS = ("nop2", "nop5", "jmp8", "jmp32", "illegal")
SHORT_SITES_SINCE = (5, 14)


def classify(ctx, code):
    """Kind index (into KINDS) and the jump target encoded at each site (0 for nops)."""
    image = ctx.image
    kind = np.full(len(code), 4, dtype=np.int8)
    encoded = np.zeros(len(code), dtype=np.uint64)
    for i, a in enumerate(code.tolist()):
        try:
            b = bytes(image.read(a, 5))
        except ValueError:
            continue
        if b[:2] == NOP2:
            kind[i] = 0
        elif b == NOP5:
            kind[i] = 1
        elif b[0] == 0xEB:
            kind[i] = 2
            encoded[i] = a + 2 + int.from_bytes(b[1:2], "little", signed=True)
        elif b[0] == 0xE9:
            kind[i] = 3
            encoded[i] = (a + 5 + int.from_bytes(b[1:5], "little", signed=True)) & (2**64 - 1)
    return kind, encoded


def rel8_reach(code, target):
    """True where a 2-byte jmp at code can reach target."""
    d = target.astype(np.int64) - (code.astype(np.int64) + 2)
    return (d >= -128) & (d <= 127)


class JumpTable(KernelTable):
    name = "__jump_table"
    start_symbol = "__start___jump_table"
    stop_symbol = "__stop___jump_table"
    dtype = np.dtype([("code", "<i4"), ("target", "<i4"), ("key", "<i8")])
    relative_fields = ("code", "target")
    relative64_fields = ("key",)

    def parse(self, ctx):
        # flags: bit 0 = branch default, bit 1 = init
        return split_key_flags(self.decode(ctx, rel=("code", "target", "key"),
                                           extra=[("flags", "u1")]))

    def _check_keys(self, ctx, findings, entries, kind):
        """The key is an 8-aligned ``struct static_key`` in writable data, and
        the site's built form follows from it: the compiler emits a nop
        exactly when the key's initial ``enabled`` equals the entry's branch
        bit (static_branch_likely/unlikely on DEFINE_STATIC_KEY_TRUE/FALSE;
        true of all 5,980 sites of Debian 6.1)."""
        key, code = entries["key"], entries["code"]
        in_data = np.zeros(len(key), bool)
        enabled = np.zeros(len(key), np.int64)
        for s in ctx.image.alloc_sections():
            if s.is_code or not (s.flags & 1):          # SHF_WRITE data only
                continue
            m = (key >= np.uint64(s.addr)) & (key + np.uint64(4) <= np.uint64(s.end))
            if m.any():
                in_data |= m
                if s.type != 8:                           # .bss keys start at 0
                    buf = np.asarray(ctx.image.section_bytes(s))
                    off = (key[m] - np.uint64(s.addr)).astype(np.int64)
                    enabled[m] = buf[off] | (buf[off + 1].astype(np.int64) << 8) | \
                        (buf[off + 2].astype(np.int64) << 16) | (buf[off + 3].astype(np.int64) << 24)
        bad_key = ~in_data | (key % np.uint64(8) != 0)
        self.report(findings, "error", "__jump_table.key", code[bad_key],
                    lambda a: f"__jump_table: key of the site at {ctx.symbol_at(a)} is not an aligned "
                              "static_key in writable data")
        branch = (entries["flags"] & 1) != 0
        nop = (kind == 0) | (kind == 1)
        wrong = ~bad_key & (kind != 4) & (nop != ((enabled != 0) == branch))
        self.report(findings, "error", "__jump_table.initial-state", code[wrong],
                    lambda a: f"__jump_table: site at {ctx.symbol_at(a)} is built as "
                              f"{'a nop' if bytes(ctx.image.read(a, 1))[0] != 0xEB and bytes(ctx.image.read(a, 1))[0] != 0xE9 else 'a jump'}"
                              ", which its key's initial state and branch bit contradict")

    def census(self, ctx, entries):
        """Static-key statistics and per-site kinds, as the verify report shows them."""
        kind, encoded = classify(ctx, entries["code"])
        counts = {k: int((kind == i).sum()) for i, k in enumerate(KINDS)}
        five = (kind == 1) | (kind == 3)
        improvable = five & rel8_reach(entries["code"], entries["target"])
        return {"total": len(entries), "nop2": counts["nop2"], "nop5": counts["nop5"],
                "jmp8": counts["jmp8"], "jmp32": counts["jmp32"],
                "improvable": int(improvable.sum()), "illegal": counts["illegal"]}, kind, encoded, improvable

    def check(self, ctx, entries):
        findings = []
        if len(entries) == 0:
            return findings
        stats, kind, encoded, improvable = self.census(ctx, entries)
        self._stats = stats
        code, target = entries["code"], entries["target"]
        self.report(findings, "error", "static_key.illegal", code[kind == 4],
                    lambda a: f"static key site {ctx.symbol_at(a)} ({a:#x}) holds "
                              f"{bytes(ctx.image.read(a, 5)).hex(' ') if ctx.in_code([a])[0] else '?'}"
                              ", not nop2/nop5/jmp8/jmp32")
        jumps = (kind == 2) | (kind == 3)
        wrong = jumps & (encoded != target)
        for a, enc, tgt in list(zip(code[wrong].tolist(), encoded[wrong].tolist(),
                                    target[wrong].tolist()))[:self.max_findings_per_check]:
            findings.append(Finding("error", "static_key.displacement", a,
                                    f"static key jump at {ctx.symbol_at(a)} goes to {enc:#x}, "
                                    f"but its __jump_table entry says {ctx.symbol_at(tgt)} ({tgt:#x})"))
        if wrong.sum() > self.max_findings_per_check:
            findings.append(Finding("error", "static_key.displacement", None,
                                    f"{int(wrong.sum())} static key jumps disagree with their targets"))
        self.check_code_refs(ctx, findings, "code", code)
        self.check_code_refs(ctx, findings, "target", target)
        if ctx.is_kernel:
            # struct static_key rules: a userspace image with a hand-made table has none
            self._check_keys(ctx, findings, entries, kind)
        self.check_same_code(ctx, findings, "target", code, target)
        if ctx.version is not None and ctx.version[:2] < SHORT_SITES_SINCE:
            self.report(findings, "error", "static_key.short-on-old-kernel",
                        code[(kind == 0) | (kind == 2)],
                        lambda a: f"2-byte static key site at {ctx.symbol_at(a)}: kernels before "
                                  "5.14 patch 5 bytes and would corrupt the code")
        else:
            self.report(findings, "warning", "static_key.improvable", code[improvable],
                        lambda a: f"5-byte static key site at {ctx.symbol_at(a)} could be 2 bytes "
                                  "(target in rel8 reach)")
        return findings
