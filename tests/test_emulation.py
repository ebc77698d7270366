"""Emulation-attributable code in a profile (linepack.profile.emulation, configs/emulation.toml)."""

import numpy as np
import pytest

from helpers import run_linepack
from linepack.errors import BadInput
from linepack.profile.emulation import base_name, emulation_shares, load_categories
from linepack.profile.model import Profile


def _profile(counts, unmapped=0):
    names = list(counts)
    n = len(names)
    arrays = {"func_addr": np.arange(n, dtype=np.uint64) * 0x100 + 0x1000,
              "func_size": np.full(n, 0x100, np.uint64), "func_local": np.zeros(n, np.uint8),
              "func_entries": np.ones(n, np.uint64), "func_blocks": np.ones(n, np.uint64),
              "func_insns": np.array([counts[k] for k in names], np.uint64),
              "func_samples": np.zeros(n, np.uint64)}
    total = sum(counts.values()) + unmapped
    return Profile({"source": "qemu", "metric": "insns", "instructions": total,
                    "unmapped": unmapped, "loops": 10}, arrays, names)


def test_base_name_strips_gcc_clone_suffixes():
    assert base_name("extract_entropy.constprop.0") == "extract_entropy"
    assert base_name("link_path_walk.part.0.constprop.0") == "link_path_walk"
    assert base_name("mix_interrupt_randomness.cold") == "mix_interrupt_randomness"
    assert base_name("blake2s_compress_generic") == "blake2s_compress_generic"


def test_shares_per_category_with_unmapped_in_the_denominator():
    prof = _profile({"blake2s_compress_generic": 300, "extract_entropy.constprop.0": 20,
                     "get_random_u32": 10, "hrtimer_interrupt": 40, "default_idle": 30,
                     "serial8250_tx_chars": 0, "kmem_cache_alloc": 500,
                     # coarse file timestamps are the workload's own work
                     "ktime_get_coarse_real_ts64": 50, "current_time": 40}, unmapped=10)
    s = emulation_shares(prof)
    assert s.total == 1000
    assert s.counts["rng"] == 330 and s.functions["rng"][0] == ("blake2s_compress_generic", 300)
    assert s.counts["timekeeping"] == 40
    assert s.counts["idle"] == 30
    assert s.counts["emulated_devices"] == 0
    assert s.share() == pytest.approx(0.4)
    assert s.share("rng") == pytest.approx(0.33)
    d = s.as_dict()
    assert d["categories"]["rng"]["top"][0] == ["blake2s_compress_generic", 300]
    assert any("rng" in ln and "33.00%" in ln for ln in s.lines())


def test_whole_name_match_only(tmp_path):
    cfg = tmp_path / "e.toml"
    cfg.write_text("rng = ['get_random_u32']\n")
    prof = _profile({"get_random_u32": 5, "get_random_u32_below": 7, "xget_random_u32": 11})
    assert emulation_shares(prof, load_categories(str(cfg))).counts == {"rng": 5}


@pytest.mark.parametrize("text", ["rng = 'blake2s'\n", "rng = ['(unclosed']\n", "rng = [\n"])
def test_bad_category_file_is_one_clear_error(tmp_path, text):
    cfg = tmp_path / "e.toml"
    cfg.write_text(text)
    with pytest.raises(BadInput) as e:
        load_categories(str(cfg))
    assert str(cfg) in str(e.value) and "\n" not in str(e.value)


def test_show_prints_the_emulation_breakdown(tmp_path):
    path = tmp_path / "p.lpprof"
    _profile({"chacha_permute": 25, "kmem_cache_free": 75}).save(str(path))
    p = run_linepack("profile", "--show", path)
    assert p.returncode == 0, p.stderr
    assert "emulation-attributable code" in p.stdout
    assert any(ln.split()[:2] == ["rng", "25.00%"] for ln in p.stdout.splitlines())
