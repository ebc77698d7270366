"""perf script import: LBR (perf 5.x / 6.1 / 6.12 brstack flavours), IP samples, KASLR shifts,
malformed input, and a native `perf record` run end to end."""

import functools
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest

from linepack.cli import main
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.profile.model import KIND_CALL, Profile
from linepack.profile.perf_script import hex_to_u64, import_perf_script, parse
import helpers

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "perf")
C_SRC = os.path.join(HERE, "fixtures", "c", "hotloop.c")
VMLINUX = os.environ.get("LINEPACK_VMLINUX") or helpers.debian_vmlinux_path()

_PLACE = re.compile(r"\{([A-Za-z_][\w.]*)(?:\+0x([0-9a-fA-F]+))?\}")


# -- helpers shared with test_fdata.py / test_profile_model.py -----------------------------

def compile_hotloop(outdir, name="hotloop", pie=True, extra=()):
    helpers.require_tool("gcc")
    out = os.path.join(str(outdir), name)
    cmd = ["gcc", "-O2", "-Wl,--emit-relocs", *(() if pie else ("-no-pie", "-fno-pie")), *extra,
           "-o", out, C_SRC]
    subprocess.run(cmd, check=True)
    return out


def func_lookup(image_path):
    ft = FunctionTable(ElfImage(image_path))
    table = {}
    for i, n in enumerate(ft.name):
        table.setdefault(n, i)
        table.setdefault(n.split(".")[0], i)     # crunch -> crunch.constprop.0
    return ft, table


def render(fixture, image_path, shift=None):
    """Fixture text with {func+0xOFF} placeholders filled in for image_path."""
    with open(os.path.join(FIXTURES, fixture)) as f:
        text = f.read()
    m = re.search(r"^# shift: (0x[0-9a-fA-F]+)", text, re.M)
    if shift is None:
        shift = int(m.group(1), 16) if m else 0
    ft, table = func_lookup(image_path)

    def sub(mm):
        i = table[mm.group(1)]
        if mm.group(2) is None:
            return ft.name[i]
        off = int(mm.group(2), 16)
        assert off < int(ft.size[i]), f"{mm.group(0)} is past the end of {ft.name[i]}"
        return f"{int(ft.start[i]) + off + shift:x}"
    return _PLACE.sub(sub, text)


def write_rendered(tmp_path, fixture, image_path, shift=None):
    p = tmp_path / fixture
    p.write_text(render(fixture, image_path, shift))
    return str(p)


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    """hotloop linked at fixed addresses (ET_EXEC), like a kernel."""
    return compile_hotloop(tmp_path_factory.mktemp("bin"), pie=False)


def one_error(err):
    """The single error line of a failed run (progress lines aside), no traceback."""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("linepack: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _hot_name(ft, table, prefix):
    return ft.name[table[prefix]]


# -- bulk parsing primitives -------------------------------------------------------------

def test_hex_to_u64_matches_int():
    toks = [b"0", b"f", b"ffffffff81234567", b"7fd590ee8f38", b"1A2b", b"ffffffffffffffff"]
    assert hex_to_u64(toks).tolist() == [int(t, 16) for t in toks]
    assert hex_to_u64([]).dtype == np.uint64


@pytest.mark.parametrize("fixture,style", [("lbr-5.x.txt", "5.x"), ("lbr-6.1.txt", "6.1"),
                                           ("lbr-6.12.txt", "6.2+")])
def test_lbr_fixtures(tmp_path, exe, fixture, style):
    path = write_rendered(tmp_path, fixture, exe)
    ps = parse(open(path, "rb").read(), path)
    assert ps.kind == "lbr" and ps.style == style
    prof = import_perf_script(path, exe)
    ft, table = func_lookup(exe)
    crunch = _hot_name(ft, table, "crunch")
    assert prof.source == "perf-lbr" and prof.meta["kaslr_offset"] == 0
    assert prof.hot_functions(1)[0][0] == crunch
    assert prof.meta["branches"] == len(ps.br_from) and prof.meta["samples"] == len(ps.ip)
    assert prof.meta["mispredicts"] == int(ps.br_mispred.sum()) >= 1
    assert prof.meta["unmapped"] == 0
    # The call main -> mix lands on mix's entry: a call edge and one entry.
    mix = int(ft.start[table["mix"]])
    calls = prof.edge_to[prof.edge_kind == KIND_CALL]
    assert mix in calls.tolist()
    assert prof.function_counts("entries")["mix"] == 1
    # Branch counts per (from, to) are aggregated.
    assert prof.edge_count.sum() == len(ps.br_from)
    assert len(np.unique(np.stack([prof.edge_from, prof.edge_to]), axis=1).T) == len(prof.edge_from)


def test_brstack_without_ip_column(tmp_path, exe):
    path = write_rendered(tmp_path, "lbr-brstack-only.txt", exe)
    prof = import_perf_script(path, exe)
    ft, table = func_lookup(exe)
    assert prof.meta["branches"] == 6 and prof.meta["samples"] == 0 and prof.meta["mispredicts"] == 1
    assert prof.hot_functions(1)[0][0] == _hot_name(ft, table, "crunch")


def test_lbr_6_12_event_flags(tmp_path, exe):
    """6.12's PN/MN events: M counts as a mispredict, N (not taken) is accepted."""
    path = write_rendered(tmp_path, "lbr-6.12.txt", exe)
    ps = parse(open(path, "rb").read(), path)
    assert len(ps.br_from) == 11
    assert int(ps.br_mispred.sum()) == 2


@pytest.mark.parametrize("fixture,samples,unmapped", [("ip-sym.txt", 14, 3), ("ip-default.txt", 7, 2),
                                                      ("ip-only.txt", 6, 0), ("ip-callchain.txt", 3, 0)])
def test_ip_fixtures(tmp_path, exe, fixture, samples, unmapped):
    path = write_rendered(tmp_path, fixture, exe)
    prof = import_perf_script(path, exe)
    ft, table = func_lookup(exe)
    assert prof.source == "perf-ip" and prof.metric == "samples"
    assert prof.meta["samples"] == samples
    assert prof.meta["unmapped"] == unmapped
    assert prof.hot_functions(1)[0][0] == _hot_name(ft, table, "crunch")
    assert len(prof.edge_from) == 0


def test_kaslr_shift_is_refused_with_the_offset(tmp_path, exe, capsys):
    path = write_rendered(tmp_path, "lbr-kaslr.txt", exe)
    out = str(tmp_path / "p.lpprof")
    rc = main(["profile", "--perf-script", path, "--image", exe, "-o", out])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("linepack: error:") and "KASLR-shifted by 0x2a00000" in err[-1]
    assert "--kaslr-offset" in err[-1]
    assert not os.path.exists(out)


@pytest.mark.parametrize("opt", ["auto", "0x2a00000"])
def test_kaslr_offset_option(tmp_path, exe, capsys, opt):
    path = write_rendered(tmp_path, "lbr-kaslr.txt", exe)
    out = str(tmp_path / "p.lpprof")
    assert main(["profile", "--perf-script", path, "--image", exe, "-o", out, "--kaslr-offset", opt]) == 0
    prof = Profile.load(out)
    assert prof.meta["kaslr_offset"] == 0x2a00000
    ft, table = func_lookup(exe)
    assert prof.hot_functions(1)[0][0] == _hot_name(ft, table, "crunch")
    assert capsys.readouterr().out.count("\n") == 1        # one summary line


def test_wrong_kaslr_offset(tmp_path, exe, capsys):
    path = write_rendered(tmp_path, "lbr-kaslr.txt", exe)
    rc = main(["profile", "--perf-script", path, "--image", exe, "-o", str(tmp_path / "p"),
               "--kaslr-offset", "0x1000"])
    assert rc == 2 and "no address falls inside a function" in capsys.readouterr().err


def test_kaslr_offset_bad_value(tmp_path, exe, capsys):
    path = write_rendered(tmp_path, "lbr-6.1.txt", exe)
    rc = main(["profile", "--perf-script", path, "--image", exe, "-o", str(tmp_path / "p"),
               "--kaslr-offset", "lots"])
    assert rc == 2 and "--kaslr-offset" in capsys.readouterr().err


@pytest.mark.parametrize("fixture,needle", [("malformed.txt", "no perf samples found (line 2"),
                                            ("mixed-garbage.txt", "3 of 7 lines are not `perf script` samples"),
                                            ("brstacksym.txt", "brstacksym")])
def test_malformed_fixture(tmp_path, exe, capsys, fixture, needle):
    path = write_rendered(tmp_path, fixture, exe)
    rc = main(["profile", "--perf-script", path, "--image", exe, "-o", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in one_error(err)


@pytest.mark.parametrize("content,needle", [
    (b"", "no perf samples found"),
    (b"\x7fELF\x02\x01\x01\0\0\0", "binary file"),
    (b"PERFILE2\0\0", "perf.data"),
    (b"hello world\nthis is not perf\n", "no perf samples found"),
])
def test_bad_input_one_line(tmp_path, exe, capsys, content, needle):
    p = tmp_path / "in.txt"
    p.write_bytes(content)
    rc = main(["profile", "--perf-script", str(p), "--image", exe, "-o", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in one_error(err)


def test_missing_inputs(tmp_path, exe, capsys):
    assert main(["profile", "--perf-script", str(tmp_path / "nope"), "--image", exe, "-o",
                 str(tmp_path / "p")]) == 2
    assert "no such file" in capsys.readouterr().err
    path = write_rendered(tmp_path, "ip-only.txt", exe)
    assert main(["profile", "--perf-script", path, "--image", str(tmp_path / "noimg"), "-o",
                 str(tmp_path / "p")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["profile", "--perf-script", path, "-o", str(tmp_path / "p")]) == 2
    assert "--image is required" in capsys.readouterr().err


def test_truncated_last_line_is_tolerated(tmp_path, exe):
    text = render("lbr-6.1.txt", exe)
    cut = text.rstrip("\n")
    cut = cut[:len(cut) - 25]            # the last entry is cut mid-address
    p = tmp_path / "cut.txt"
    p.write_text(cut)
    prof = import_perf_script(str(p), exe)
    assert prof.meta["branches"] > 0


def test_other_image_is_refused(tmp_path, exe, capsys):
    """Kernel addresses against a userspace binary: nothing maps, one clear line."""
    p = tmp_path / "k.txt"
    p.write_text(" ffffffff81a0121c\n ffffffff81a01230\n ffffffff8134cc50\n")
    rc = main(["profile", "--perf-script", str(p), "--image", exe, "-o", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert rc == 2 and "none of 3 addresses falls inside a function" in err


@pytest.mark.realkernel
def test_kernel_kaslr_fixture(tmp_path, capsys):
    assert os.path.exists(VMLINUX), f"{VMLINUX} not fetched (tools/setup.sh fetches it)"
    path = write_rendered(tmp_path, "kernel-lbr-kaslr.txt", VMLINUX)
    out = str(tmp_path / "k.lpprof")
    rc = main(["profile", "--perf-script", path, "--image", VMLINUX, "-o", out])
    err = capsys.readouterr().err
    assert rc == 2 and "KASLR-shifted by 0x1e000000" in err
    assert main(["profile", "--perf-script", path, "--image", VMLINUX, "-o", out,
                 "--kaslr-offset", "auto"]) == 0
    prof = Profile.load(out)
    assert prof.meta["kaslr_offset"] == 0x1e000000
    assert prof.hot_functions(1)[0][0] == "vfs_read"
    assert prof.function_counts("entries")["vfs_read"] == 1
    assert prof.meta["build_id"] == ElfImage(VMLINUX).build_id


# -- native perf record, end to end ------------------------------------------------------

PERF_CANNOT_RECORD = "perf record cannot record here"


@functools.lru_cache(maxsize=None)
def perf_cannot_record():
    """None when perf can sample on this host, else why not: `perf record -e cpu-clock`
    of a short busy loop must succeed and `perf script` must show samples. Containers and
    some VMs offer no perf events (perf_event_paranoid, seccomp, no PMU); that is the one
    reason a perf test may skip. Once this probe passed, any later perf failure fails."""
    helpers.require_tool("perf")
    with tempfile.TemporaryDirectory(prefix="perf-probe-") as d:
        data = os.path.join(d, "probe.data")
        try:
            r = subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "1000", "-o", data,
                                "--", "sh", "-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{PERF_CANNOT_RECORD}: {e}"
        if r.returncode != 0 or not os.path.exists(data):
            return f"{PERF_CANNOT_RECORD}: " + (r.stderr.strip().splitlines() or ["?"])[-1][:200]
        s = subprocess.run(["perf", "script", "-i", data, "-F", "ip"], capture_output=True,
                           text=True, timeout=120)
        if s.returncode != 0 or not s.stdout.strip():
            return f"{PERF_CANNOT_RECORD}: a busy loop gave no samples"
    return None


def record_native(tmp_path, binary, rounds="400"):
    why = perf_cannot_record()
    if why:
        pytest.skip(why)
    data = str(tmp_path / "perf.data")
    r = subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "5000", "-o", data, "--",
                        binary, rounds], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"perf record failed although the probe recorded: {r.stderr[-500:]}"
    out = tmp_path / "perf.txt"
    with open(out, "w") as f:
        subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym"], stdout=f,
                       stderr=subprocess.DEVNULL, check=True, timeout=300)
    assert os.path.getsize(out) > 0, "perf recorded no samples although the probe did"
    return str(out)


@pytest.fixture(scope="module")
def pie(tmp_path_factory):
    return compile_hotloop(tmp_path_factory.mktemp("pie"), pie=True)


def test_native_perf_record_end_to_end(tmp_path, pie, capsys):
    text = record_native(tmp_path, pie)
    out = str(tmp_path / "native.lpprof")
    assert main(["profile", "--perf-script", text, "--image", pie, "-o", out]) == 0
    summary = capsys.readouterr().out
    prof = Profile.load(out)
    ft, table = func_lookup(pie)
    assert prof.hot_functions(1)[0][0] == _hot_name(ft, table, "crunch"), prof.summary()
    assert prof.meta["kaslr_offset"] != 0            # PIE load bias, applied automatically
    assert prof.meta["build_id"] == ElfImage(pie).build_id
    assert "hottest " + _hot_name(ft, table, "crunch") in summary
    assert main(["profile", "--show", out, "--image", pie]) == 0
    assert _hot_name(ft, table, "crunch") in capsys.readouterr().out
