"""Debian 13's 6.12 and trixie-backports' 7.3 cloud kernels as shipped (the -dbg
vmlinux, the vmlinuz and the modules of the same build: ``linepack fetch --series
S [--vmlinuz] [--module PATH]``), rewritten from a vfs-mix profile by ``relayout
VMLINUX --vmlinuz VMLINUZ`` and packed into the distribution's own boot image by
``bzimage OUT --vmlinuz VMLINUZ --layout-map TSV``, then booted under QEMU:

- ``verify NEW_VMLINUZ --vmlinux OUT --against VMLINUX`` is clean;
- the new vmlinuz boots with KASLR five times at five distinct offsets, each boot
  printing stock's vfs-mix result, loading three modules of the package unchanged
  (kyber-iosched's ``__jump_table`` has sites on a core kernel static key) and
  showing moved functions in /proc/kallsyms at their new address plus the offset;
- the torture boot (tests/torture.py: every tracepoint flipped, the function tracer
  on all functions, kprobes with stack traces, the same three modules) matches stock's;
- with call-depth tracking selected (Skylake-Client-v1, ``retbleed=stuff``) the
  kernel patches its accounting thunks into the moved functions' paddings and the
  workload prints stock's result;
- every workload that boots on these kernels prints stock's result (slab-bulk builds
  its module with the kernel's linux-headers: Debian 13's kbuild tools need glibc
  2.38 and gcc-14, which a Debian 12 host lacks; docs/testing.md).

One profile per kernel, one relayout + bzimage per kernel and strategy (env
LINEPACK_NEWKERNEL_STRATEGIES, comma-separated, default "pack,blocks"), shared by the tests.
"""

import os
import re

import pytest

from helpers import run_linepack
import helpers
import torture

SERIES = ("6.12", "7.3")
STRATEGIES = [s for s in os.environ.get("LINEPACK_NEWKERNEL_STRATEGIES", "pack,blocks").split(",") if s]
MODULES = ("fs/fat/fat.ko", "fs/fat/vfat.ko", "block/kyber-iosched.ko")
# kyber's sites on block_rq_insert's tracepoint key, which the core kernel defines
STATIC_KEY_MODULE, CORE_KEY = "block/kyber-iosched.ko", "__tracepoint_block_rq_insert"
PROFILE_LOOPS = 20
BOOT_LOOPS = 20
KASLR_BOOTS, KASLR_MAX_BOOTS = 5, 7      # five distinct offsets; two spare boots for collisions
# Loop counts of the workload boots: the result line, not a measurement, is checked.
# slab-bulk is left out (module docstring).
WORKLOAD_LOOPS = {"vfs-mix": 20, "vfs-mix-ext4": 20, "vfs-mix-nvme": 20, "pipe": 200,
                  "vdso": 1000, "fork-exec": 20, "tcp-loopback": 50, "epoll": 200,
                  "dirwalk": 2, "fsync": 20}
NOT_BOOTED = {"slab-bulk"}
BAD = ("Oops", "BUG:", "WARNING:", "Unknown symbol", "Call Trace")
CDT = dict(env={"spectre_v2": "retpoline", "retbleed": "stuff", "loglevel": "7"},
           extra_args=("-cpu", "Skylake-Client-v1,+rdrand"))

pytestmark = [pytest.mark.realkernel, pytest.mark.qemu]
_requirements = helpers.requirements("qemu-system-x86_64", "gcc")


# -- the shipped kernels and their rewrites ---------------------------------------------
@pytest.fixture(scope="module", params=SERIES)
def shipped(request, tmp_path_factory):
    """The series' vmlinux, vmlinuz and three modules (tools/setup.sh fetches the
    kernels; the modules are fetched here once: a failure fails the tests)."""
    from linepack import targets
    from linepack.errors import LinepackError
    series = request.param
    try:
        files = {"series": series, "vmlinux": targets.debian_vmlinux(series=series),
                 "vmlinuz": targets.debian_vmlinuz(series=series),
                 "modules": [targets.debian_module(m, series=series) for m in MODULES]}
    except LinepackError as e:
        pytest.fail(f"Debian {series} kernel or modules unavailable (linepack fetch --series "
                    f"{series}): {e}")
    files["dir"] = tmp_path_factory.mktemp(f"boot{series}")
    return files


@pytest.fixture(scope="module")
def profile(shipped, kernel_profile):
    return kernel_profile(shipped["vmlinux"], PROFILE_LOOPS)


@pytest.fixture(scope="module", params=STRATEGIES)
def layout(request, shipped, profile):
    """relayout from the vmlinuz's relocations, then the new vmlinuz."""
    s, strategy = shipped, request.param
    d = s["dir"] / strategy.replace(":", "-")
    d.mkdir()
    out, tsv, new = d / "vmlinux", d / "layout.tsv", d / "vmlinuz"
    r = run_linepack("relayout", s["vmlinux"], "--vmlinuz", s["vmlinuz"], "--profile", profile,
                     "--strategy", strategy, "-o", out, "--layout-map", tsv, "-q", timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_linepack("bzimage", out, "--vmlinuz", s["vmlinuz"], "--layout-map", tsv, "-o", new,
                     timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(s, strategy=strategy, out=out, tsv=tsv, new=new, layout_dir=d)


def test_verify_against_clean(layout):
    """``verify NEW_VMLINUZ --vmlinux OUT --against VMLINUX``: the new boot image's
    payload is relayout's output (segments, KASLR table), and that output is
    equivalent to the shipped vmlinux."""
    rep = layout["layout_dir"] / "against.json"
    p = run_linepack("verify", "-q", layout["new"], "--vmlinux", layout["out"], "--against",
                     layout["vmlinux"], "--layout-map", layout["tsv"], "--json", rep, timeout=1800)
    import json
    r = json.loads(rep.read_text())
    errors = [f for f in r["findings"] if f["severity"] == "error"]
    assert p.returncode == 0 and not errors, errors[:5]
    # every code byte explained (7.x's kexec_debug_gdt, a sized object in the kexec
    # code in .data, is data by its symbol)
    assert not r["coverage"]["unexplained"], r["coverage"]["unexplained"][:5]
    assert r["equivalence_moved_functions"] > 100
    assert r["ibt_entries_checked"] > 10_000
    pf = r["function_prefixes"]
    assert pf["count"] > 40_000 and pf["detached"] == 0 and pf["not_nop"] == 0
    # every function with a prefix in the shipped kernel keeps the call-depth thunk's
    # room of NOPs (9 bytes: blocks trims split functions' paddings to it)
    assert pf["thunk_template"] == 9 and pf["short"] == 0
    assert r["prefix_room_checked"] > 40_000
    if layout["strategy"] == "blocks":
        assert pf["bytes"] == [9, 16] and r["equivalence_blocks"]["padding_dropped"] > 100
    bi = r["boot_image"]
    assert bi["segments_compared"] >= 2 and bi["relocations"]["abs64"] > 100_000
    assert r["boot_image_counts"] == {"bootimage.payload": 0, "bootimage.reloc-range": 0,
                                      "bootimage.reloc-value": 0, "bootimage.reloc-missing": 0}


# -- booting ------------------------------------------------------------------------------
def _boot(kernel, workload="vfs-mix", loops=BOOT_LOOPS, names=("_text",), **kw):
    from linepack.profile.qemu import run_workload
    env = {"lp_kallsyms": ",".join(names), **kw.pop("env", {})}
    return run_workload(str(kernel), workload, loops=loops, icount=False, timeout=900, env=env,
                        **kw)


def _complaints(serial):
    return [ln for ln in serial.splitlines() if any(b in ln for b in BAD)]


def core_key_sites(ko, vmlinux):
    """How many ``__jump_table`` entries of module ``ko`` name a static key the core
    kernel (``vmlinux``) defines, by name: their key field's relocation is against an
    undefined symbol of the module."""
    from elftools.elf.elffile import ELFFile
    from linepack.image.elf import ElfImage
    core = set(ElfImage(vmlinux).symbol_names())
    with open(ko, "rb") as f:
        elf = ELFFile(f)
        rela = elf.get_section_by_name(".rela__jump_table")
        syms = elf.get_section_by_name(".symtab")
        if rela is None:
            return {}
        out = {}
        for r in rela.iter_relocations():
            sym = syms.get_symbol(r["r_info_sym"])
            if sym["st_shndx"] == "SHN_UNDEF" and sym.name in core:
                out[sym.name] = out.get(sym.name, 0) + 1
        return out


def moved_sample(layout, k=12):
    """Moved functions whose name is unique in the rewritten symbol table:
    {name: new link-time address}, about ``k`` of them plus a few hot ones."""
    from linepack.image.elf import ElfImage
    names, syms = ElfImage(str(layout["out"])).symbol_table()
    count = {}
    for n in names:
        count[n] = count.get(n, 0) + 1
    moved = []
    for line in open(layout["tsv"]):
        if line.startswith("#"):
            continue
        name, old, new, _ = line.rstrip("\n").split("\t")
        if old != new and count.get(name) == 1 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            moved.append((name, int(new, 16)))
    moved.sort()
    sample = dict(moved[::max(1, len(moved) // k)][:k])
    for hot in ("vfs_read", "do_sys_openat2", "_raw_spin_lock"):
        sample.update((n, a) for n, a in moved if n == hot)
    return sample


@pytest.fixture(scope="module")
def stock_boot(shipped):
    """The shipped vmlinuz, KASLR on, with the three modules: the reference result."""
    from linepack.ship import kaslr
    res = _boot(shipped["vmlinuz"], modules=shipped["modules"])
    off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(shipped["vmlinuz"]))
    assert off is not None and off % (2 << 20) == 0, res.serial[-1500:]
    assert not _complaints(res.serial), _complaints(res.serial)
    return res


def test_modules_are_the_packages_and_one_uses_core_static_keys(shipped):
    from linepack import targets
    rel = targets.release(targets.resolve_abi(series=shipped["series"]), shipped["series"])
    for ko in shipped["modules"]:
        data = open(ko, "rb").read()
        assert data[:4] == b"\x7fELF" and f"vermagic={rel} SMP".encode() in data, ko
    sites = core_key_sites(shipped["modules"][MODULES.index(STATIC_KEY_MODULE)],
                           shipped["vmlinux"])
    assert sites.get(CORE_KEY, 0) >= 1, sites


def test_kaslr_boots_load_modules_with_stock_result(layout, stock_boot):
    """Boots of the new vmlinuz until five distinct KASLR offsets (at most seven boots):
    each prints stock's result, loads the three modules, and shows moved functions at
    their new address plus that boot's offset."""
    from linepack.ship import kaslr
    link_text = kaslr.bzimage_link_text(str(layout["new"]))
    sample = moved_sample(layout)
    assert len(sample) >= 10, sample
    want_mods = [f"linepack-module {os.path.basename(m)} loaded" for m in MODULES]
    offsets = []
    for _ in range(KASLR_MAX_BOOTS):
        res = _boot(layout["new"], names=["_text"] + sorted(sample), modules=layout["modules"])
        assert res.result_line == stock_boot.result_line
        got_mods = torture.lines(res.serial, "linepack-module")
        assert got_mods == want_mods, got_mods
        assert not _complaints(res.serial), _complaints(res.serial)
        off = kaslr.kaslr_offset(res.serial, link_text)
        assert off is not None and off % (2 << 20) == 0, res.serial[-1500:]
        got = kaslr.kallsyms_lines(res.serial)
        for name, addr in sample.items():
            assert [a for a, _ in got.get(name, [])] == [addr + off], (name, got.get(name))
        offsets.append(off)
        if len(set(offsets)) == KASLR_BOOTS:
            break
    print(f"{layout['series']} {layout['strategy']}: KASLR offsets",
          ", ".join(hex(o) for o in offsets))
    assert len(set(offsets)) == KASLR_BOOTS, [hex(o) for o in offsets]


# -- the torture boot -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def torture_initrd(shipped):
    return torture.build_initrd(shipped["dir"], shipped["modules"])


@pytest.fixture(scope="module")
def torture_stock(shipped, torture_initrd):
    return torture.torture_boot(shipped["vmlinuz"], torture_initrd,
                                torture.kprobe_specs(shipped["vmlinux"]))


def test_stock_passes_the_torture(shipped, torture_stock):
    from linepack.profile import workloads
    s = torture_stock.serial
    T = torture
    assert T.lines(s, "linepack-result torture") == \
        ["linepack-result torture modules=3 steps=ok kprobes_hit=3/3"], s[-3000:]
    assert T.lines(s, "linepack-result vfs-mix") == [workloads.run_native("vfs-mix", T.LOOPS)]
    assert [ln.split()[1] for ln in T.lines(s, "linepack-module")] == \
        [os.path.basename(m) for m in MODULES]
    assert "io scheduler kyber registered" in s
    assert not T.kernel_complaints(s), T.kernel_complaints(s)
    firsts = [f[:2] for f in T.stacks(s)]
    unlink = T.unlink_function(shipped["vmlinux"])
    for pair in (("copy_process", "kernel_clone"), (unlink, "__x64_sys_unlink"),
                 ("vfs_unlink", unlink)):
        assert pair in firsts, firsts
    assert any(f and f[0] == T.NO_OWN_ORC_ENTRY for f in T.stacks(s)), T.stacks(s)
    assert T.problems(torture_stock, torture_stock) == []


def test_layout_passes_the_torture(layout, torture_initrd, torture_stock):
    """As stock; a block-level layout also gets kprobes on a split function's hot part
    and every piece of a cold part on the torture's error path (at least one fires,
    its stack trace starts in `name.cold` and reaches the syscall entry)."""
    from linepack.image.elf import ElfImage
    T = torture
    vmlinux = layout["out"]
    specs = T.kprobe_specs(vmlinux)
    img = ElfImage(str(vmlinux))
    names = set(img.symbol_names())
    split, cold_fn, cold_specs = [], None, []
    if layout["strategy"].split(":")[0].startswith("blocks"):
        # (the compiler's own .cold parts are in stock too: only a block-level layout's count)
        split = [n for n in T.VFS_PATH if n + ".cold" in names][:5]
        cold_fn = next((n for n in T.ERROR_PATH if n + ".cold" in names), None)
        assert split and cold_fn, "blocks split none of the VFS-path / error-path functions"
        cold_specs = T.cold_piece_specs(img, cold_fn)
    specs += [p for p in split[:1] if p not in specs] + cold_specs
    run = T.torture_boot(layout["new"], torture_initrd, specs)
    found = T.problems(run, torture_stock, may_miss=cold_specs)
    assert found == [], run.serial[-3000:]
    if cold_specs:
        hits = {ln.split()[1]: int(ln.split("hits=")[1])
                for ln in T.lines(run.serial, "torture-kprobe")}
        assert any(hits.get(p) for p in cold_specs), hits
        cold = [st for st in T.raw_stacks(run.serial) if st and st[0] == cold_fn + ".cold"]
        assert cold and all(st[-1] == "entry_SYSCALL_64_after_hwframe" for st in cold), cold


# -- call-depth tracking --------------------------------------------------------------------
@pytest.fixture(scope="module")
def cdt_stock(shipped):
    return _boot(shipped["vmlinuz"], **CDT)


def _padding_warnings(res):
    return [ln.split("]", 1)[1] for ln in res.serial.splitlines() if "Invalid padding" in ln]


def lost_paddings(layout):
    """Moved functions whose 16 bytes before the entry were single-byte NOPs in stock
    (the padding call-depth tracking patches, with or without a __pfx_ symbol) and
    whose last SKL_TMPL_SIZE bytes before the entry (the call-depth template, measured
    on the image: all the kernel compares and patches) are not NOPs in the rewrite:
    the kernel refuses to patch those (and says so only once)."""
    from linepack.image.elf import ElfImage
    from linepack.kernel.prefixes import thunk_template_size
    old_im, new_im = ElfImage(str(layout["vmlinux"])), ElfImage(str(layout["out"]))
    tmpl = thunk_template_size(old_im)
    assert tmpl == 9, tmpl                  # one sarq $5, %gs:depth (CALL_THUNKS_DEBUG off)
    nops, need = b"\x90" * 16, b"\x90" * tmpl
    lost, kept, seen = [], 0, set()
    for line in open(layout["tsv"]):
        if line.startswith("#"):
            continue
        name, old, new, _ = line.rstrip("\n").split("\t")
        old, new = int(old, 16), int(new, 16)
        if old == new or old in seen or name.startswith("__pfx_"):
            continue
        seen.add(old)
        if bytes(old_im.read(old - 16, 16)) == nops:
            if bytes(new_im.read(new - tmpl, tmpl)) == need:
                kept += 1
            else:
                lost.append(name)
    return kept, lost


def test_call_depth_tracking_boot(layout, cdt_stock):
    """A Skylake CPU model with retbleed=stuff: the kernel selects call-depth tracking
    and patches its accounting thunks into the moved functions' paddings at boot
    (.call_sites); the workload prints stock's result. The one padding the build left
    without NOPs (an asm function) draws the same warning in both; every moved
    function's NOP padding is still there."""
    kept, lost = lost_paddings(layout)
    assert kept > 100 and not lost, lost[:20]
    res = _boot(layout["new"], **CDT)
    for r in (cdt_stock, res):
        assert "RETBleed: Mitigation: Stuffing" in r.serial
        assert "callthunks: Setting up call depth tracking" in r.serial
    assert res.result_line == cdt_stock.result_line
    assert _padding_warnings(res) == _padding_warnings(cdt_stock)
    assert not [ln for ln in _complaints(res.serial) if "Invalid padding" not in ln]
    assert not [ln for ln in res.serial.splitlines() if "Oops" in ln or "BUG:" in ln]


def _core_reader(core_path):
    """read(phys, n) over a QEMU ``dump-guest-memory`` ELF core (paging off: its
    PT_LOAD segments are guest-physical ranges)."""
    from elftools.elf.elffile import ELFFile
    f = open(core_path, "rb")
    segs = [(s["p_paddr"], s["p_filesz"], s["p_offset"]) for s in ELFFile(f).iter_segments()
            if s["p_type"] == "PT_LOAD"]

    def read(phys, n):
        for pa, size, off in segs:
            if pa <= phys and phys + n <= pa + size:
                f.seek(off + phys - pa)
                return f.read(n)
        raise ValueError(f"{phys:#x} not in the dump")
    return read


def _phys(image, vaddr):
    """The physical load address of ``vaddr`` (the vmlinux's program headers: a PVH
    boot loads it there, without KASLR)."""
    for ph in image.phdrs:
        if ph["type"] == 1 and ph["vaddr"] <= vaddr < ph["vaddr"] + ph["memsz"]:
            return int(ph["paddr"]) + vaddr - int(ph["vaddr"])
    raise ValueError(f"{vaddr:#x} in no segment")


SARQ_RIP = b"\x65\x48\xc1\x3d"         # sarq $imm8, %gs:disp32(%rip)


def _same_thunk(got, at, template, t):
    """``got`` (the bytes at ``at``) is the template (at ``t``) as the kernel patches it:
    the same bytes, a RIP-relative operand (6.12, 7.3: sarq $5, %gs:__x86_call_depth)
    relocated to reach the same per-CPU variable from ``at``."""
    if len(got) != len(template) or got[:4] != template[:4] or got[8:] != template[8:]:
        return False
    if template[:4] != SARQ_RIP:
        return got == template
    n = len(template)               # the disp32 is followed by the imm8: ends the insn

    def disp(b):
        return int.from_bytes(b[4:8], "little", signed=True)
    return at + n + disp(got) == t + n + disp(template)


def test_call_depth_thunks_patched_into_trimmed_paddings(layout, tmp_path):
    """``blocks`` keeps only the call-depth template's size of a split function's
    __pfx_ padding (kernel/prefixes.py). The rewritten vmlinux booted with call-depth
    tracking selected, parked after vfs-mix and its memory dumped: the kernel patched
    its accounting thunk (the template's bytes) into the trimmed paddings of the
    functions it calls directly, and every other trimmed padding is still NOPs. (pack
    keeps every padding whole: checked on its symbols, without a boot.)"""
    from linepack.image.elf import ElfImage
    from linepack.kernel.prefixes import prefix_symbols, thunk_template_size
    from linepack.profile.qemu import dump_at_hold
    im = ElfImage(str(layout["out"]))
    if layout["strategy"] != "blocks":
        # pack moves whole functions with their whole 16-byte paddings: nothing to boot for
        assert set(prefix_symbols(im)[2].tolist()) == {16}
        return
    tmpl = thunk_template_size(im)
    template = bytes(im.read(im.symbol_address("skl_call_thunk_template"), tmpl))
    names, addr, size = prefix_symbols(im)
    trimmed = [(n, a) for n, a, z in zip(names, addr.tolist(), size.tolist()) if z == tmpl]
    assert len(trimmed) > 100
    dump = tmp_path / "cdt.core"
    try:
        res = dump_at_hold(str(layout["out"]), "vfs-mix", str(dump), loops=BOOT_LOOPS,
                           timeout=900, env=CDT["env"], extra_args=CDT["extra_args"])
        assert "RETBleed: Mitigation: Stuffing" in res.serial
        assert "callthunks: Setting up call depth tracking" in res.serial
        assert not _padding_warnings(res) or all("__pfx_" not in w for w in _padding_warnings(res))
        read = _core_reader(dump)
        # the dump holds the image where the program headers say (no KASLR)
        t = im.symbol_address("skl_call_thunk_template")
        assert read(_phys(im, t), tmpl) == template
        patched, untouched, other = [], 0, []
        for n, a in trimmed:
            got = read(_phys(im, a), tmpl)
            if _same_thunk(got, a, template, t):
                patched.append(n)
            elif got == b"\x90" * tmpl:
                untouched += 1
            else:
                other.append((n, got.hex()))
    finally:
        if dump.exists():
            dump.unlink()
    assert not other, other[:10]
    assert len(patched) > 50, (len(patched), untouched)


def test_prefix_room_mutation_is_found(layout, tmp_path):
    """verify's --against prefix check on the real rewrite: clean as written; with the
    bytes right before one moved function's entry overwritten (int3), one named
    finding, ``equiv.prefix-room``, at that entry."""
    from linepack.image.elf import ElfImage
    from linepack.kernel.base import ImageContext
    from linepack.kernel.prefixes import check_prefix_room, thunk_template_size
    from linepack.verify.addrmap import match_functions
    from linepack.verify.findings import add_findings
    im = ElfImage(str(layout["out"]))
    tmpl = thunk_template_size(im)
    victim = next(n for n in ("vfs_read", "_raw_spin_lock", "do_sys_openat2")
                  if im.symbol_address(n) is not None)
    entry = im.symbol_address(victim)
    assert bytes(im.read(entry - tmpl, tmpl)) == b"\x90" * tmpl
    bad = tmp_path / "vmlinux"
    data = bytearray(open(layout["out"], "rb").read())
    sec = im.section_at(entry)
    off = sec.offset + entry - tmpl - sec.addr
    data[off:off + tmpl] = b"\xcc" * tmpl
    bad.write_bytes(bytes(data))
    del data
    try:
        octx = ImageContext(ElfImage(str(layout["vmlinux"])))
        for new, lost in ((str(layout["out"]), []), (str(bad), [entry])):
            nctx = ImageContext(ElfImage(new))
            oi, ni, _ = match_functions(octx, nctx)
            findings, counter = [], {}
            assert check_prefix_room(octx, nctx, oi, ni, findings, counter, add_findings) > 40_000
            assert [f.address for f in findings if f.check == "equiv.prefix-room"] == lost
            assert counter.get("equiv.prefix-room", 0) == len(lost)
    finally:
        bad.unlink()


# -- every workload -------------------------------------------------------------------------
def test_workload_set_is_all_but_the_module_one():
    from linepack.profile import workloads
    assert set(WORKLOAD_LOOPS) | NOT_BOOTED == set(workloads.names())
    assert all(workloads.load(n).module_source for n in NOT_BOOTED)


@pytest.fixture(scope="module")
def stock_results(shipped):
    """{workload: the stock vmlinuz's result line}, filled on first use."""
    return {}


@pytest.mark.parametrize("name", sorted(WORKLOAD_LOOPS))
def test_workload_prints_stock_result(layout, stock_results, name):
    loops = WORKLOAD_LOOPS[name]
    if name not in stock_results:
        stock_results[name] = _boot(layout["vmlinuz"], name, loops).result_line
    res = _boot(layout["new"], name, loops)
    assert res.result_line == stock_results[name]
    assert not _complaints(res.serial), _complaints(res.serial)



# -- evaluate ------------------------------------------------------------------------------
EVAL_LOOPS = 50


def test_evaluate_shows_stock_and_layout_of_both_kernels(layout, tmp_path):
    """``evaluate --kernel`` boots each -dbg vmlinux and its rewrite (PVH, no KASLR) under
    the L1i plugin: one table, each row against the stock kernel of its own build (the
    other series' stock kernel is its own baseline), the same kernel work and result."""
    import json
    from linepack import targets
    other = next(s for s in SERIES if s != layout["series"])
    other_vmlinux = targets.debian_vmlinux(series=other)
    me, lay = f"{layout['series']} stock", f"{layout['series']} {layout['strategy']}"
    out = tmp_path / "ev.json"
    r = run_linepack("evaluate", "--kernel", f"{me}={layout['vmlinux']}",
                     "--kernel", f"{lay}={layout['out']}",
                     "--kernel", f"{other} stock={other_vmlinux}",
                     "--loops", EVAL_LOOPS, "--cache", "intel-32k-8w", "--json", out, timeout=1800)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert f"against the first kernel of the same build: {me}, {other} stock" in r.stdout, r.stdout
    rows = {row["layout"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {me, lay, f"{other} stock"}
    assert rows[lay]["baseline"] == me and rows[f"{other} stock"]["baseline"] == f"{other} stock"
    assert rows[lay]["result_line"] == rows[me]["result_line"]
    assert all(row["misses"] > 0 for row in rows.values())
    assert rows[lay]["text_growth_pct"] is not None
    assert rows[f"{other} stock"]["text_growth_pct"] == 0
