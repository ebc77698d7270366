"""kallsyms' grown arrays at the end of the kernel text, when the gap after the
read-only segment is too small (relayout/kernel/kallsyms_cold.py ``_text_tail``).

Debian 13's generic 6.12 kernel (167,000 symbols) needs 670 KB there and has 462 KB;
its -dbg package is 1 GB, so the test takes Debian 13's 6.12 cloud kernel, which the
suite has anyway, and gives its relayout no gap: ``blocks`` from the vmlinuz then
puts kallsyms_offsets into the int3 filler before ``_etext``. The output verifies
against the shipped vmlinux, ships as a vmlinuz, and boots with KASLR: the workload
prints stock's result and /proc/kallsyms (which reads the moved arrays) lists
``.cold`` parts and moved functions at their new address plus the boot's offset.
"""

import pytest

import helpers
from helpers import run_linepack

pytestmark = [pytest.mark.realkernel, pytest.mark.qemu]
_requirements = helpers.requirements("qemu-system-x86_64", "gcc")


@pytest.fixture(scope="module")
def tail_layout(tmp_path_factory, kernel_profile):
    from linepack import targets
    from linepack.cli import main
    from linepack.relayout.kernel import kallsyms_cold
    d = tmp_path_factory.mktemp("tail")
    vmlinux, vmlinuz = targets.debian_vmlinux(series="6.12"), targets.debian_vmlinuz(series="6.12")
    prof = kernel_profile(vmlinux, 20)
    room = kallsyms_cold._room

    def no_gap(image, first):            # the gap after the read-only segment: 0 bytes
        seg, start, offset, _ = room(image, first)
        return seg, start, offset, start
    out, tsv, new = d / "vmlinux", d / "layout.tsv", d / "vmlinuz"
    mp = pytest.MonkeyPatch()
    mp.setattr(kallsyms_cold, "_room", no_gap)
    try:
        rc = main(["relayout", str(vmlinux), "--vmlinuz", str(vmlinuz), "--profile", str(prof),
                   "--strategy", "blocks", "-o", str(out), "--layout-map", str(tsv),
                   "--json", str(d / "relayout.json"), "-q"])
    finally:
        mp.undo()
    assert rc == 0
    r = run_linepack("bzimage", out, "--vmlinuz", vmlinuz, "--layout-map", tsv, "-o", new,
                     timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(vmlinux=vmlinux, vmlinuz=vmlinuz, out=out, tsv=tsv, new=new, dir=d)


def test_arrays_at_the_end_of_the_text(tail_layout):
    from linepack.image.elf import ElfImage
    old, im = ElfImage(str(tail_layout["vmlinux"])), ElfImage(str(tail_layout["out"]))
    sec = im.section(kallsyms_section())
    etext = im.symbol_address("_etext")
    text = im.section(".text")
    assert etext == old.symbol_address("_etext")
    # .text ends where the new section starts; both below _etext, page-aligned
    assert text.addr + text.size == sec.addr < sec.addr + sec.size <= etext
    assert sec.addr % 4096 == 0 and not sec.is_code
    assert text.size < old.section(".text").size
    offsets = im.symbol_address("kallsyms_offsets")
    assert sec.addr <= offsets < sec.addr + sec.size
    assert im.symbol_address("__end_rodata") == old.symbol_address("__end_rodata")
    # the read-only segment did not grow
    assert im.phdrs["memsz"][0] == old.phdrs["memsz"][0]


def kallsyms_section():
    from linepack.relayout.kernel.kallsyms_cold import SECTION_NAME
    return SECTION_NAME


def test_verify_against_clean(tail_layout):
    import json
    rep = tail_layout["dir"] / "against.json"
    p = run_linepack("verify", "-q", tail_layout["new"], "--vmlinux", tail_layout["out"],
                     "--against", tail_layout["vmlinux"], "--layout-map", tail_layout["tsv"],
                     "--json", rep, timeout=1800)
    r = json.loads(rep.read_text())
    errors = [f for f in r["findings"] if f["severity"] == "error"]
    assert p.returncode == 0 and not errors, errors[:5]
    assert r["equivalence_moved_data_fields"] > 0


def test_boots_and_kallsyms_reads_the_moved_arrays(tail_layout):
    from linepack.image.elf import ElfImage
    from linepack.profile.qemu import run_workload
    from linepack.ship import kaslr
    im = ElfImage(str(tail_layout["out"]))
    names, _ = im.symbol_table()
    old_names = set(ElfImage(str(tail_layout["vmlinux"])).symbol_table()[0])
    # cold parts the split added (kallsyms entries relayout wrote), each name once
    counts = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    cold = sorted(n for n, c in counts.items() if c == 1 and n.endswith(".cold") and
                  n not in old_names)[:4]
    assert len(cold) == 4, cold
    moved = {n: im.symbol_address(n) for n in ("vfs_read", "do_sys_openat2", *cold)}
    stock = run_workload(str(tail_layout["vmlinuz"]), "vfs-mix", loops=20, icount=False,
                         timeout=900)
    res = run_workload(str(tail_layout["new"]), "vfs-mix", loops=20, icount=False, timeout=900,
                       env={"lp_kallsyms": ",".join(["_text", *moved])})
    assert res.result_line == stock.result_line
    off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(str(tail_layout["new"])))
    assert off is not None and off % (2 << 20) == 0, res.serial[-1500:]
    got = kaslr.kallsyms_lines(res.serial)
    for name, addr in moved.items():
        assert [a for a, _ in got.get(name, [])] == [addr + off], (name, got.get(name))
