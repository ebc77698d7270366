"""Shared by the reference-recovery tests on real kernels: relayout from the
link relocations and from recovered references, compared section by section."""

import json

from linepack.image.elf import ElfImage
from linepack.relayout.kernel.recovered import keep_first, pin_units, units_named
from linepack.image.shared import elf_image
from linepack.relayout.units import units_of
from linepack.relayout.driver import relayout
import helpers


def relayout_both(vmlinux, stripped, vmlinuz, profile, strategy, tmp_path):
    """(link summary, recovered summary, [allocated sections that differ]).

    The recovered run is the CLI on the stripped copy. It pins a few units the
    link does not need to (unexplained data values, labels that are also
    function starts, label arithmetic; listed in its summary) and keeps a few
    first in their region: the link run gets the same constraints, so both plan the same layout and any byte that
    differs is a reference handled differently."""
    b, jb = tmp_path / f"recovered.{strategy}", tmp_path / f"recovered.{strategy}.json"
    r = helpers.run_linepack("relayout", stripped, "--vmlinuz", vmlinuz, "--profile", profile,
                             "--strategy", strategy, "--strip-debug", "-q", "-o", b, "--json", jb)
    assert r.returncode == 0, r.stderr[-3000:]
    sb = json.loads(jb.read_text())
    pins = sb["references"]["pinned_units"]
    from linepack.image import shared
    from linepack.relayout import strategies
    from linepack.relayout.driver import load_profile_full
    # the pins go into the shared image's cached units, which relayout() reads; the
    # image is dropped from the cache afterwards so later tests see the vmlinux as it is
    try:
        image = elf_image(vmlinux)
        units, _, _ = units_of(image)
        keep_first(units, units_named(units, sb["references"]["kept_first"]))
        pin_units(units, units_named(units, pins))
        lp = load_profile_full(str(profile), vmlinux)
        a = tmp_path / f"link.{strategy}"
        sa, _, _ = relayout(vmlinux, str(a), strategies.get({"strategy": strategy}),
                            hotness=lp.hotness, calls=lp.calls, blocks=lp.blocks, debug="strip")
    finally:
        shared._images.clear()
    ia, ib = ElfImage(str(a)), ElfImage(str(b))
    differ = [s.name for s in ia.alloc_sections() if s.type != 8 and
              bytes(ia.section_bytes(s)) != bytes(ib.section_bytes(ib.section(s.name)))]
    return sa, sb, differ
