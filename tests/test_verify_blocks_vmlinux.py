"""`verify --against` at block level on Debian's 6.1 cloud vmlinux rewritten with
`relayout --strategy blocks`.

The real output must verify with no finding; then one copy of it gets eight injected breakages, each
in a different place, and verify must name every one (counts per check come from
the JSON report, which lists at most 20 findings per check):

- an inserted jmp's displacement off by one            -> equiv.edge
- a re-encoded branch's displacement off by one        -> equiv.relaxation
- the ORC entry at a moved piece's start changed       -> equiv.orc-block-start
- a __jump_table entry left at its original address    -> equiv.table-stale
- a block map row claiming its predecessor's bytes     -> equiv.block-lost + equiv.block-twice
- an added `.cold` kallsyms entry renamed               -> equiv.kallsyms-cold
- two neighbours in kallsyms_seqs_of_names swapped      -> kallsyms.seqs_of_names

Budget: a 20-loop profile, one relayout, two verify runs (about 2 minutes).
"""

import json
import shutil

import numpy as np
import pytest

from block_scan import block_mutation_rows, counting_scan
from helpers import run_linepack
import helpers

VMLINUX = helpers.debian_vmlinux_path()
PROFILE_LOOPS = 20
pytestmark = [pytest.mark.realkernel, pytest.mark.qemu, pytest.mark.slow]
_requirements = helpers.requirements("qemu-system-x86_64", vmlinux=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("verify-blocks")


@pytest.fixture(scope="module")
def blocks_out(work, kernel_profile):
    prof = kernel_profile(VMLINUX, PROFILE_LOOPS)
    out = work / "vmlinux.blocks"
    r = run_linepack("relayout", VMLINUX, "--profile", prof, "--strategy", "blocks", "-o", out,
                     "-q", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def verify(path, work, name):
    out = work / f"{name}.json"
    p = run_linepack("verify", path, "--against", VMLINUX, "--json", out, "-q", timeout=900)
    assert p.returncode in (0, 1), p.stderr[-2000:]
    rep = json.loads(out.read_text())
    return p, rep


@pytest.fixture(scope="module")
def baseline(blocks_out, work):
    return verify(blocks_out, work, "baseline")


def test_blocks_output_verifies(baseline):
    p, rep = baseline
    stats = rep["equivalence_blocks"]
    assert stats["split_functions"] > 100 and stats["instructions"] > 10000
    assert stats["branches_reencoded"] > 0 and stats["jmps_inserted"] > 0
    counts = {k: v for k, v in rep["equivalence_counts"].items() if v}
    assert counts == {}, counts
    assert p.returncode == 0 and not rep["findings"], rep["findings"][:5]
    # the DWARF checks (no debuginfo.* finding above) looked at split code too
    assert rep["debuginfo_split_units_checked"] > 0 and rep["debuginfo_scopes_checked"] > 1000
    # kallsyms carries one `.cold` entry per split function, and its own check (names
    # decode and agree with the symtab, addresses sorted, markers, seqs_of_names in
    # name order) passes on the rebuilt arrays
    assert "equiv.kallsyms-cold" in rep["equivalence_counts"]
    assert rep["tables"]["kallsyms"]["ok"]
    from linepack.image.elf import ElfImage
    from linepack.kernel.base import ImageContext
    from linepack.kernel.kallsyms import Kallsyms
    n_old = len(Kallsyms().parse(ImageContext(ElfImage(VMLINUX))))
    assert rep["tables"]["kallsyms"]["entries"] == n_old + stats["split_functions"]


def _file_patch(f, image, addr, data):
    f.seek(image.vaddr_to_offset(addr))
    f.write(data)


def test_injected_breakages_are_named(blocks_out, baseline, work):
    import capstone
    from linepack.image import blockmap as bm
    from linepack.image.elf import ElfImage
    from linepack.kernel.base import ImageContext
    from linepack.kernel.jump_table import JumpTable
    from linepack.kernel.orc import ORC_ENTRY, OrcTable

    img = ElfImage(str(blocks_out))
    ctx = ImageContext(img)
    rows = bm.read_blockmap(img)
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    used = set()                     # one breakage per function

    def pick(sel, ok=lambda r: True):
        for k in np.nonzero(sel)[0].tolist():
            if int(rows["func"][k]) not in used and ok(rows[k]):
                used.add(int(rows["func"][k]))
                return k
        raise AssertionError("no candidate row")

    def insn(addr):
        return next(md.disasm(bytes(img.read(addr, 16)), addr, 1))

    bad = work / "vmlinux.blocks.bad"
    shutil.copyfile(blocks_out, bad)
    want = {}
    with open(bad, "r+b") as f:
        # 1. an inserted jmp (e9 rel32) that lands one byte off
        k = pick(rows["kind"] == bm.KIND_JMP_INSERTED, lambda r: int(r["new_len"]) == 5)
        a = int(rows["new"][k])
        disp = int.from_bytes(bytes(img.read(a + 1, 4)), "little", signed=True)
        _file_patch(f, img, a + 1, (disp + 1).to_bytes(4, "little", signed=True))
        want["equiv.edge"] = a
        # 2. a relaxed jcc (0f 8x rel32) that lands one byte off
        k = pick(rows["kind"] == bm.KIND_BRANCH,
                 lambda r: int(r["new_len"]) == 6 and insn(int(r["new"])).size == 6)
        a = int(rows["new"][k])
        disp = int.from_bytes(bytes(img.read(a + 2, 4)), "little", signed=True)
        _file_patch(f, img, a + 2, (disp + 1).to_bytes(4, "little", signed=True))
        want["equiv.relaxation"] = a
        # 3. the ORC entry at a moved piece's start (one that is right today) changed
        orc = OrcTable().parse(ctx)
        ips = orc["ip"]
        orc_base = img.symbol_address("__start_orc_unwind")
        old_img = ElfImage(VMLINUX)
        orc_old = OrcTable().parse(ImageContext(old_img))
        fields = ["sp_offset", "bp_offset", "bits"]

        def has_entry(r):
            # an entry exactly at the piece start, and today it says what the original's lookup says
            i = int(np.searchsorted(ips, r["new"], side="right")) - 1
            j = int(np.searchsorted(orc_old["ip"], r["old"], side="right")) - 1
            return int(r["kind"]) == bm.KIND_COPIED and i >= 0 and ips[i] == r["new"] and \
                orc["sp_offset"][i] > 0 and all(orc[n][i] == orc_old[n][j] for n in fields)
        k = pick(rows["old_len"] > 0, has_entry)
        old_img.close()
        a = int(rows["new"][k])
        i = int(np.searchsorted(ips, np.uint64(a), side="right")) - 1
        ent = np.zeros(1, ORC_ENTRY)
        ent["sp_offset"], ent["bp_offset"], ent["bits"] = \
            orc["sp_offset"][i] + 8, orc["bp_offset"][i], orc["bits"][i]
        _file_patch(f, img, orc_base + i * ORC_ENTRY.itemsize, ent.tobytes())
        want["equiv.orc-block-start"] = a
        # 4. a static-key site in a split function whose table entry still names the
        #    old code (sites are usually pieces of their own: re-sized branches)
        jt = JumpTable().parse(ctx)
        placed = rows[rows["old_len"] > 0]
        placed = placed[np.argsort(placed["new"], kind="stable")]
        for e in jt:
            j = np.searchsorted(placed["new"], e["code"], side="right") - 1
            if j < 0 or int(placed["func"][j]) in used:
                continue
            r = placed[j]
            off = int(e["code"]) - int(r["new"])
            if off < int(r["new_len"]) and (off == 0 or int(r["kind"]) == bm.KIND_COPIED):
                old_code = int(r["old"]) + off
                entry = int(e["entry"])
                _file_patch(f, img, entry, (old_code - entry).to_bytes(4, "little", signed=True))
                used.add(int(r["func"]))
                want["equiv.table-stale"] = int(e["code"])
                break
        # 5. a block map row that claims its predecessor's bytes instead of its own
        def prev_piece(k):
            p = k - 1
            while p >= 0 and rows["old_len"][p] == 0:
                p -= 1
            return p
        for k in np.nonzero((rows["kind"] == bm.KIND_COPIED) & (rows["old_len"] > 0))[0].tolist():
            prev = prev_piece(k)
            if prev >= 0 and rows["func"][prev] == rows["func"][k] and \
                    int(rows["func"][k]) not in used and rows["old_len"][k] <= rows["old_len"][prev]:
                break
        used.add(int(rows["func"][k]))
        sec = img.section(bm.SECTION_NAME)
        row = rows[k].copy()
        lost = int(row["old"])
        row["old"] = rows["old"][prev]
        f.seek(sec.offset + bm.HEADER.itemsize + k * bm.BLOCKMAP_ROW.itemsize)
        f.write(row.tobytes())
        want["equiv.block-lost"] = lost
        want["equiv.block-twice"] = int(rows["old"][prev])
        # 6. kallsyms: an added `.cold` entry renamed (its last token replaced by the
        #    one-character token "e"), and two neighbours in seqs_of_names swapped
        from linepack.kernel.kallsyms import Kallsyms
        ks = Kallsyms()
        ke = ks.parse(ctx)
        # the added `.cold` symbols follow the original's locals in the symtab
        from linepack.image.elf import SHT_SYMTAB
        orig = ElfImage(VMLINUX)
        first = next(s.info for s in orig.sections if s.type == SHT_SYMTAB)
        extra = len(img.symtab) - len(orig.symtab)
        orig.close()
        sym_names = img.symbol_names()
        cold_syms = {(sym_names[j], int(img.symtab["value"][j]))
                     for j in range(first, first + extra)}
        picks = [i for i, (n, a) in enumerate(zip(ks.names, ke["addr"].tolist()))
                 if (n, a) in cold_syms]
        i = picks[0]
        tokens = ks._tokens(ctx)
        names_at = img.symbol_address("kallsyms_names")
        _file_patch(f, img, names_at + int(ks._record_bounds[i + 1]) - 1,
                    bytes([tokens.index(b"e")]))
        want["equiv.kallsyms-cold"] = int(ke["addr"][i])
        seq_at = img.symbol_address("kallsyms_seqs_of_names")
        pos = {int(v): k for k, v in enumerate(ks.seqs.tolist())}
        k = pos[picks[1]]
        assert ks.names[int(ks.seqs[k])] != ks.names[int(ks.seqs[k + 1])]
        a, b = int(ks.seqs[k]), int(ks.seqs[k + 1])
        _file_patch(f, img, seq_at + 3 * k, b.to_bytes(3, "big") + a.to_bytes(3, "big"))
    img.close()
    assert len(want) == 7

    p, rep = verify(bad, work, "broken")
    assert p.returncode == 1
    before = baseline[1]["equivalence_counts"]
    after = rep["equivalence_counts"]
    for check, addr in want.items():
        assert after.get(check, 0) > before.get(check, 0), (check, before, after)
        listed = [f["address"] for f in rep["findings"] if f["check"] == check]
        if addr is not None and after[check] <= 20:    # all listed: the place is named
            assert f"{addr:#x}" in listed, (check, hex(addr), listed)
    # kallsyms' own check (standalone, part of the same run) names the swapped pair
    assert not any(f["check"] == "kallsyms.seqs_of_names" for f in baseline[1]["findings"])
    assert any(f["check"] == "kallsyms.seqs_of_names" for f in rep["findings"]), \
        [f for f in rep["findings"] if f["check"].startswith("kallsyms")]


def test_mutation_self_test_runs_the_c_scan(blocks_out, monkeypatch):
    """The mutation self-test at block level (verify/mutation.py block_mutations) on
    the real output: copied instructions of split functions corrupted one at a time in
    a PatchedImage, each named by the block check, whose C scan (blocks.c) really
    read the patched bytes (its calls counted; tests/test_mutation_blocks.py shows
    that a scan reading the unpatched image lets such mutations through)."""
    calls = counting_scan(monkeypatch)
    rows = block_mutation_rows(VMLINUX, blocks_out, seed=10, count=30)
    assert len(rows) >= 30 and len(calls) >= len(rows)
    missed = [(r[1], hex(r[4])) for r in rows if not r[5]]
    print(f"block mutations: {len(rows) - len(missed)}/{len(rows)} named, "
          f"{len(calls)} C scans")
    assert missed == []
