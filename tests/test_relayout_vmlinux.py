"""relayout on Debian's 6.1 cloud vmlinux (cached by the set-up): plan invariants,
stock identity, table checks, ORC padding, static-key re-check, refusals. The
booted tests (VFS-mix, kallsyms, modules, strategies) are in test_relayout_boot.py."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.relayout.driver import relayout
import helpers

VMLINUX = helpers.debian_vmlinux_path()
pytestmark = pytest.mark.realkernel
_requirements = helpers.requirements(vmlinux=True)


@pytest.fixture(scope="module")
def vfs_profile(tmp_path_factory):
    """A small synthetic hotness map over real function names (no QEMU needed)."""
    ft = FunctionTable(ElfImage(VMLINUX))
    names = [n for n in ("vfs_write", "vfs_read", "do_sys_openat2", "path_openat", "ksys_lseek",
                         "_raw_spin_lock", "schedule", "memcpy", "kmem_cache_alloc",
                         "filemap_map_pages", "unlink", "do_unlinkat", "__fput")
             if ft.index_of(n) is not None]
    # Plus every 50th function of the main text, to have a few hundred hot ones.
    names += [ft.name[i] for i in range(100, 40000, 50)]
    d = tmp_path_factory.mktemp("vmprof")
    p = d / "prof.json"
    p.write_text(json.dumps({"functions": {n: 1000 - k % 900 for k, n in enumerate(names)}}))
    return p, {n: float(1000 - k % 900) for k, n in enumerate(names)}


def test_stock_keeps_all_allocated_bytes(tmp_path):
    out = tmp_path / "vmlinux.stock"
    summary, plan, rw = relayout(VMLINUX, str(out), "stock")
    assert summary["units_moved"] == 0
    a, b = ElfImage(VMLINUX), ElfImage(str(out))
    for s in a.alloc_sections():
        if s.type != 8:
            assert bytes(a.section_bytes(s)) == bytes(b.section_bytes(b.sections[s.index])), s.name
    assert summary["dwarf"] == "rewritten"       # nothing moved: same addresses
    assert summary["dwarf_address_fields_moved"] == 0
    assert a.section(".debug_info").size == b.section(".debug_info").size


def test_pack_invariants(tmp_path, vfs_profile):
    _, hot = vfs_profile
    out = tmp_path / "vmlinux.pack"
    summary, plan, rw = relayout(VMLINUX, str(out), "pack", hotness=hot)
    assert not summary["problems"], summary["problems"][:3]
    assert summary["units_moved"] > 1000
    text = ElfImage(VMLINUX).section(".text")
    assert summary["text_growth_bytes"] <= text.size // 100        # <= 1 %
    assert summary["hot_lines_after"] <= summary["hot_lines_before"]
    ft = FunctionTable(ElfImage(str(out)))
    u = plan.units
    for name in hot:
        i = ft.index_of(name)
        ui = int(u.funcs[FunctionTable(rw.image).index_of(name)])
        if ui < 0 or u.pinned[ui] or len(u.members[ui]) > 1 or plan.heat[ui] < 1:
            continue
        a, s = int(ft.start[i]), int(ft.size[i])
        if s > 64:
            assert a % 64 == 0, name
        else:
            assert a // 64 == (a + s - 1) // 64, name
    for t in ("__ex_table", "orc_unwind", "__mcount_loc"):
        assert summary[f"table.{t}"] > 0
    _check_orc_padding(summary, rw, str(out))
    assert summary["static_keys.sites_rechecked"] > 5000


def _check_orc_padding(summary, rw, out):
    """What the unwinder sees is unchanged: the ORC lookup (last entry <= IP) at
    every translated instruction of the original gives the original's state,
    including in functions without an ORC entry of their own (they must not
    inherit the state of their new predecessor); and every padding run the
    layout inserted starts under an undefined-state entry."""
    from linepack.kernel.base import ImageContext
    from linepack.kernel.orc import OrcTable
    old_t, new_t = OrcTable(), OrcTable()
    octx, nctx = ImageContext(rw.image), ImageContext(ElfImage(out))
    eo, en = old_t.parse(octx), new_t.parse(nctx)
    assert len(eo) == len(en)
    errors = [f for f in new_t.check(nctx, en) if f.severity == "error"]
    assert not errors, errors[:3]
    starts, _ = rw.amap.padding_runs()
    assert summary["orc_unwind.padding_runs"] == len(starts) > 1000
    j = np.searchsorted(en["ip"], starts, side="right") - 1
    covered = (j >= 0) & ((en["bits"][np.maximum(j, 0)] & 0xF) == 0)
    assert int((~covered).sum()) == 0

    def state(e, at):
        order = np.argsort(e["ip"], kind="stable")
        ip = e["ip"][order]
        k = np.searchsorted(ip, at, side="right") - 1
        ok = k >= 0
        st = e[order][np.maximum(k, 0)]
        return ok, st["sp_offset"], st["bp_offset"], st["bits"]
    a = octx.disasm.addr
    b, ok = rw.amap.map(a)
    a, b = a[ok], b[ok]                  # int3/nop fill the layout dropped has no counterpart
    so, sn = state(eo, a), state(en, b)
    differ = np.zeros(len(a), bool)
    for x, y in zip(so, sn):
        differ |= x != y
    moved = b != a
    assert moved.sum() > 1_000_000
    assert int(differ.sum()) == 0, [hex(int(x)) for x in a[differ][:5]]


def test_new_image_passes_table_checks(tmp_path, vfs_profile):
    """The lead's table checks (verify) find no errors the original does not have."""
    from linepack.kernel import TABLES
    from linepack.kernel.base import ImageContext
    _, hot = vfs_profile
    out = tmp_path / "vmlinux.a64"
    relayout(VMLINUX, str(out), "align-all 64", hotness=hot)

    def errors(path):
        ctx = ImageContext(ElfImage(path))
        n = {}
        for cls in TABLES:
            t = cls()
            try:
                f = t.check(ctx, t.parse(ctx))
            except Exception as e:  # noqa: BLE001
                n[cls.name] = f"crash: {e}"
                continue
            n[cls.name] = sum(1 for x in f if x.severity == "error")
        return n
    before, after = errors(VMLINUX), errors(str(out))
    worse = {k: (before.get(k), v) for k, v in after.items() if v != before.get(k)}
    assert not worse


def test_cli_refusals(tmp_path):
    def run(*a):
        return subprocess.run([sys.executable, "-m", "linepack", "relayout", *a],
                              capture_output=True, text=True)
    r = run(VMLINUX, "-o", VMLINUX, "--strategy", "stock")
    assert r.returncode == 2 and "input" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run(VMLINUX, "-o", str(tmp_path / "x"), "--strategy", "nonsense")
    assert r.returncode == 2 and "unknown strategy" in r.stderr
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"functions": {"vfs_read": 1}, "build_id": "00" * 20}))
    r = run(VMLINUX, "-o", str(tmp_path / "x"), "--profile", str(p))
    assert r.returncode == 2 and "another build" in r.stderr
    assert not (tmp_path / "x").exists()


def _bare_rewriter(amap):
    from linepack.relayout.rewriter import Rewriter
    rw = object.__new__(Rewriter)
    rw.image, rw.amap, rw.stats, rw.problems = ElfImage(VMLINUX), amap, {}, []
    return rw


def test_static_key_sites_rechecked_after_layout():
    """Every __jump_table site is re-checked; a 2-byte site whose target the layout
    moved out of rel8 reach is a clear error (the layout must keep them together)."""
    from linepack.image.addrmap import AddressMap
    from linepack.kernel.base import ImageContext
    from linepack.kernel.jump_table import JumpTable, classify
    from linepack.relayout.rewriter import RewriteError
    rw = _bare_rewriter(AddressMap.identity())
    rw.check_static_keys()
    st = rw.stats
    assert st["static_keys.sites_rechecked"] == st["static_keys.two_byte"] + \
        st["static_keys.five_byte"] + st["static_keys.illegal"] > 5000
    assert st["static_keys.two_byte"] > 1000 and st["static_keys.illegal"] == 0
    ctx = ImageContext(rw.image)
    e = JumpTable().parse(ctx)
    kind, _ = classify(ctx, e["code"])
    i = int(np.nonzero(kind == 0)[0][0])                 # a nop2 site
    code, tgt = int(e["code"][i]), int(e["target"][i])
    assert code != tgt
    # Move only the target's byte 4 KiB away: out of rel8 reach of the site.
    rw = _bare_rewriter(AddressMap([tgt], [tgt + 1], [tgt + 4096]))
    with pytest.raises(RewriteError, match=r"2-byte static-key site\(s\) would not reach"):
        rw.check_static_keys()


def test_align_all_512_refused_with_missing_bytes_and_hint(tmp_path):
    """align-all 512 cannot fit before the pinned 2 MiB-aligned SRSO thunk: exit 2,
    one line that says how many bytes are missing and which alignment fits."""
    out = tmp_path / "x"
    out.write_text("left alone")                 # a refused run never touches the output
    r = subprocess.run([sys.executable, "-m", "linepack", "relayout", VMLINUX, "-o", str(out),
                        "--strategy", "align-all 512", "-q"], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert re.search(r"align-all 512 does not fit: .* needs \d+ more bytes; "
                     r"the largest alignment that fits is align-all (64|128|256)$", lines[0]), lines
    assert out.read_text() == "left alone"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]      # no temp files left


def _census(image_path):
    """(sites, 2-byte sites) of the image's __jump_table, from its bytes."""
    from linepack.kernel.base import ImageContext
    from linepack.kernel.jump_table import JumpTable, classify
    ctx = ImageContext(ElfImage(image_path))
    e = JumpTable().parse(ctx)
    kind, _ = classify(ctx, e["code"])
    return len(e), int(((kind == 0) | (kind == 2)).sum())


def test_blocks_summary_states_static_keys_once(tmp_path):
    """Block level: one "static keys:" line says what the input had and what
    relayout chose (issue 20: two lines, "0 5-byte could be 2-byte" and "10 made
    short, 44 made long", read as if they disagreed). Profile: the first 16 bytes
    of every 50th function run, the rest of each is cold (no QEMU needed)."""
    from linepack.profile.model import Profile
    ft = FunctionTable(ElfImage(VMLINUX))
    idx = [i for i in range(100, 40000, 50) if int(ft.size[i]) >= 64]
    n = len(idx)
    prof = Profile.from_blocks(VMLINUX, ft.start[idx], np.full(n, 16), np.full(n, 4),
                               np.full(n, 1000))
    prof.save(tmp_path / "entry.lpprof")
    out, js = tmp_path / "vmlinux.blocks", tmp_path / "summary.json"
    r = subprocess.run([sys.executable, "-m", "linepack", "relayout", VMLINUX, "-o", str(out),
                        "--strategy", "blocks", "--profile", str(tmp_path / "entry.lpprof"),
                        "--json", str(js), "--strip-debug", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(js.read_text())
    assert s["split"]["functions_split"] > 50
    lines = [ln for ln in r.stdout.splitlines() if "static keys" in ln]
    assert len(lines) == 1, lines
    sites, two_before = _census(VMLINUX)
    n_after, two_after = _census(str(out))
    short, long_ = s["static_keys.made_short"], s["static_keys.made_long"]
    assert sites == n_after == s["static_keys.sites_rechecked"]
    assert two_after == s["static_keys.two_byte"] == two_before + short - long_
    assert short + long_ > 0                  # the split re-encoded some: a statement to make
    assert lines[0] == (
        f"  static keys:       {sites} sites: {two_before} 2-byte + {sites - two_before} 5-byte "
        f"before; relayout made {short} short, {long_} long, kept "
        f"{s['static_keys.unchanged']}; after: {two_after} 2-byte (all reach their target), "
        f"{sites - two_after} 5-byte ({s['static_keys.five_byte_in_rel8_reach']} of them "
        "within rel8 reach)")
