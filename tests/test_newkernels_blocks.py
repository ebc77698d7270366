"""``relayout --strategy blocks`` of Debian 13's 6.12 and trixie-backports' 7.3 cloud
kernels as shipped (references recovered from the vmlinuz, no link relocations):

- relayout exits 0 with one kallsyms entry per ``.cold`` part, placed in the old
  arrays' storage except what cannot fit there (6.12: seqs_of_names, as
  relative_base splits the storage; 7.3: one small array);
- ``verify OUT --against VMLINUX`` has no error (the moved kallsyms arrays'
  code fields are told by value, as relayout told them);
- a kallsyms lookup, done as kernel/kallsyms.c does it (the last symbol at or
  below the address, the first of its aliases), names the function at the first,
  middle and last byte of each split function's hot part (from the block map) and
  ``name.cold`` (type ``t``) at those of its cold part.

Heavy (a profile boot per kernel and the ~400 MB vmlinux): run under the shared lock.
"""

import json

import numpy as np
import pytest

from helpers import run_linepack

pytestmark = [pytest.mark.realkernel, pytest.mark.qemu]
PROFILE_LOOPS = 10


@pytest.fixture(scope="module", params=("6.12", "7.3"))
def blocks(request, tmp_path_factory):
    from linepack import targets
    from linepack.errors import LinepackError
    series = request.param
    try:
        vmlinux = targets.debian_vmlinux(series=series)
        vmlinuz = targets.debian_vmlinuz(series=series)
    except LinepackError as e:
        pytest.skip(f"Debian {series} kernel unavailable: {e}")
    d = tmp_path_factory.mktemp(f"blocks{series}")
    prof = d / "vfs.prof"
    r = run_linepack("profile", "--kernel", vmlinux, "--workload", "vfs-mix",
                     "--loops", PROFILE_LOOPS, "-o", prof, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out, js = d / "vmlinux", d / "relayout.json"
    r = run_linepack("relayout", vmlinux, "--vmlinuz", vmlinuz, "--profile", prof,
                     "--strategy", "blocks", "--strip-debug", "-q", "-o", out, "--json", js,
                     timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(series=series, vmlinux=vmlinux, out=str(out), summary=json.loads(js.read_text()),
                dir=d)


def test_cold_entries_fit_the_old_storage(blocks):
    s = blocks["summary"]
    assert s["split"]["functions_split"] > 50
    assert s["kallsyms.cold_entries"] > 50
    from linepack.image.elf import ElfImage
    old = ElfImage(blocks["vmlinux"])
    n = int(old.view(old.symbol_address("kallsyms_num_syms"), 1, "<u4")[0])
    # what goes past the read-only segment: one array, never kallsyms_names (before:
    # all of it): with a few dozen .cold parts 6.12's seqs_of_names (3 bytes a symbol)
    # and 7.3's markers (4 bytes per 256 symbols); with hundreds (every hot function
    # split: the planner finds room for all of them) 6.12's offsets (4 bytes a
    # symbol) and 7.3's seqs_of_names
    k = n + s["kallsyms.cold_entries"]
    limit = 4 * k if blocks["series"] == "6.12" else 3 * k
    assert s["kallsyms.section_bytes"] <= limit


def test_verify_against_clean(blocks):
    rep = blocks["dir"] / "against.json"
    p = run_linepack("verify", "-q", blocks["out"], "--against", blocks["vmlinux"], "--json", rep,
                     timeout=1800)
    r = json.loads(rep.read_text())
    errors = [f for f in r["findings"] if f["severity"] == "error"]
    assert p.returncode == 0 and not errors, errors[:5]


def test_kallsyms_lookup_of_hot_and_cold_parts(blocks):
    from linepack.image.elf import ElfImage
    from linepack.kernel.base import ImageContext
    from linepack.kernel.kallsyms import Kallsyms
    old, new = ElfImage(blocks["vmlinux"]), ElfImage(blocks["out"])
    table = Kallsyms()
    entries = table.parse(ImageContext(new))
    addr = entries["addr"]
    assert (addr[1:] >= addr[:-1]).all()      # unsigned order: absolute per-CPU ones first

    def lookup(x):
        """kernel/kallsyms.c get_symbol_pos: the last symbol at or below x, then the
        first of the symbols at that address."""
        i = int(np.searchsorted(addr, np.uint64(x), side="right")) - 1
        i = int(np.searchsorted(addr, addr[i], side="left"))
        return table.names[i], table.types[i]

    # each split function's hot and cold part, from the block map relayout wrote
    from linepack.image import blockmap as bm
    rows = bm.read_blockmap(new)
    onames, osyms = old.symbol_table()
    aliases = {}                         # names valid for the code at an original address
    for nm, v in zip(onames, osyms["value"].tolist()):
        aliases.setdefault(int(v), set()).add(nm)
    funcs = np.unique(rows["func"][rows["part"] == bm.PART_COLD])
    assert len(funcs) == blocks["summary"]["kallsyms.cold_entries"]
    end = rows["new"] + rows["new_len"].astype(np.uint64)
    checked = 0
    for f in funcs.tolist():
        name = onames[f]
        want_hot = aliases[int(osyms["value"][f])]
        for part, want in ((bm.PART_HOT, want_hot), (bm.PART_COLD, {name + ".cold"})):
            sel = (rows["func"] == f) & (rows["part"] == part) & (rows["new_len"] > 0)
            lo, hi = int(rows["new"][sel].min()), int(end[sel].max())
            if part == bm.PART_HOT:     # from the entry on (the __pfx_ padding is its piece too)
                entry = sel & (rows["old"] == osyms["value"][f])
                lo = int(rows["new"][entry].min())
            for x in sorted({lo, (lo + hi) // 2, hi - 1}):
                got, typ = lookup(x)
                assert got in want, (hex(x), got, want)
                checked += 1
            if part == bm.PART_COLD:
                assert lookup(lo)[1] == "t"
    assert checked >= 4 * len(funcs)
