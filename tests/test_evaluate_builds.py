"""Kernels of several builds in one evaluate table (each row against the first kernel of
its own build), and the Debian release a banner or boot-image version string names."""

import pytest

from linepack.errors import LinepackError
from linepack import targets
from linepack.evaluate import table


def _row(label, misses, insns, result="r", baseline=None):
    r = {"layout": label, "cache": "intel-32k-8w", "mode": "booted", "misses": misses,
         "fetches": 10 * misses, "miss_rate": 0.1, "instructions": insns, "hot_lines": 1,
         "text_growth_pct": 0.0, "time_s": 1.0, "result_line": result}
    if baseline:
        r["baseline"] = baseline
    return r


def test_rows_compare_with_their_own_builds_baseline():
    rows = [_row("6.12 stock", 1000, 10_000, baseline="6.12 stock"),
            _row("6.12 pack", 900, 10_001, baseline="6.12 stock"),
            _row("7.3 stock", 2000, 50_000, "other", baseline="7.3 stock"),
            _row("7.3 pack", 2200, 50_002, "other", baseline="7.3 stock")]
    text = table.format_rows(rows)
    assert "against the first kernel of the same build: 6.12 stock, 7.3 stock" in text
    got = {ln.split()[0] + " " + ln.split()[1]: ln.split()[3] for ln in text.splitlines()
           if ln.startswith(("6.12", "7.3"))}
    assert got == {"6.12 stock": "+0.00%", "6.12 pack": "-10.00%", "7.3 stock": "+0.00%",
                   "7.3 pack": "+10.00%"}
    # another build's different work and result are not problems; within a build they are
    assert table.cross_check_rows(rows) == []
    rows[3]["result_line"] = "bad"
    assert [p.split(":")[0] for p in table.cross_check_rows(rows)] == ["7.3 pack"]


def test_one_build_keeps_the_first_row_as_baseline():
    rows = [_row("stock", 1000, 10_000), _row("pack", 500, 10_001)]
    text = table.format_rows(rows)
    assert "same build" not in text and "-50.00%" in text


def test_block_level_tolerance_from_a_labels_last_word():
    from linepack.evaluate.booted import (BLOCK_LEVEL_TOLERANCE, INSTRUCTION_TOLERANCE,
                                          instruction_tolerance)
    assert instruction_tolerance("7.3 blocks") == BLOCK_LEVEL_TOLERANCE
    assert instruction_tolerance("blocks:0.5") == BLOCK_LEVEL_TOLERANCE
    assert instruction_tolerance("7.3 pack") == INSTRUCTION_TOLERANCE


def test_release_of_a_banner_or_boot_image_version():
    assert targets.build_of_release("Linux version 6.12.118+deb13-cloud-amd64 (debian-kernel@"
                                    "lists.debian.org) (x86_64-linux-gnu-gcc-14") == \
        ("6.12", 118, "cloud")
    assert targets.build_of_release("7.3.4+deb13-cloud-amd64 (debian-kernel@lists.debian.org) "
                                    "#1 SMP PREEMPT_DYNAMIC") == ("7.3", 4, "cloud")
    assert targets.build_of_release("6.1.0-56-cloud-amd64") == ("6.1", 56, "cloud")
    assert targets.build_of_release("6.12.117+deb12-cloud-amd64 #1") == ("6.12-deb12", 117, "cloud")
    # the other flavours: generic (-amd64) and PREEMPT_RT (-rt-amd64)
    assert targets.build_of_release("6.1.0-56-amd64") == ("6.1", 56, "generic")
    assert targets.build_of_release("Linux version 6.12.118+deb13-amd64 (debian-kernel@") == \
        ("6.12", 118, "generic")
    assert targets.build_of_release("6.12.118+deb13-rt-amd64 #1 SMP PREEMPT_RT") == \
        ("6.12", 118, "rt")
    assert targets.build_of_release("6.1.0-56-foo-amd64") == (None, None, None)
    assert targets.build_of_release("") == (None, None, None)


def test_flavour_names_its_packages():
    """Each flavour names the release and packages Debian uses for it."""
    assert targets.release(56, "6.1", "generic") == "6.1.0-56-amd64"
    assert targets.release(118, "6.12", "rt") == "6.12.118+deb13-rt-amd64"
    s = targets.series_info("7.3", "generic")
    rel = s.release(4)
    assert (s.dbg.format(rel=rel), s.image.format(rel=rel)) == \
        ("linux-image-7.3.4+deb13-amd64-dbg", "linux-binary-unsigned-7.3.4+deb13-amd64")
    assert s.pkg_re.findall("linux-image-7.3.4+deb13-amd64-dbg\n"
                            "linux-image-7.3.4+deb13-cloud-amd64-dbg\n") == ["4"]
    with pytest.raises(LinepackError, match="unknown kernel flavour 'arm64'"):
        targets.series_info("6.12", "arm64")


def test_each_backports_series_names_its_own_packages():
    """trixie-backports' 7.2 beside 7.3: the same package layout, each series its own
    releases (a 7.2 package is no 7.3 one, and the other way round)."""
    s72, s73 = targets.series_info("7.2"), targets.series_info("7.3")
    rel = s72.release(12)
    assert rel == "7.2.12+deb13-cloud-amd64"
    assert (s72.dbg.format(rel=rel), s72.image.format(rel=rel), s72.vmlinuz.format(rel=rel)) == \
        ("linux-image-7.2.12+deb13-cloud-amd64-dbg",
         "linux-binary-unsigned-7.2.12+deb13-cloud-amd64",
         "usr/lib/modules/7.2.12+deb13-cloud-amd64/vmlinuz.unsigned")
    names = ("linux-image-7.2.12+deb13-cloud-amd64-dbg\nlinux-image-7.3.4+deb13-cloud-amd64-dbg\n"
             "linux-image-7.2.9+deb13-cloud-amd64-dbg\n")
    assert s72.pkg_re.findall(names) == ["12", "9"] and s73.pkg_re.findall(names) == ["4"]
    assert s72.env == "LINEPACK_KERNEL_ABI_7_2" and s73.env == "LINEPACK_KERNEL_ABI_7_3"
    assert targets.build_of_release("Linux version 7.2.12+deb13-cloud-amd64 (debian-kernel@") \
        == ("7.2", 12, "cloud")
    assert targets.build_of_release("7.3.4+deb13-rt-amd64 #1 SMP PREEMPT_RT") == ("7.3", 4, "rt")
