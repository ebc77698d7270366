"""kallsyms growth for block-level layouts (tools/relayout/kernel/kallsyms_cold.py and the
encoding in tools/kernel/kallsyms.py), without a relayout:

- names encoded with Debian 6.1's own token table decode back to the same text and
  take no more tokens than the link's own records (fewest tokens);
- a name with a character the token table cannot express is refused;
- the placement of the grown arrays: old storage reused largest first, names and
  markers together, no overlaps, the rest in the gap.

The booted and verified results are in test_torture_boot.py and
test_verify_blocks_vmlinux.py.
"""


import numpy as np
import pytest

@pytest.fixture(scope="module")
def kallsyms(debian_vmlinux):
    from linepack.image.elf import ElfImage
    from linepack.kernel.base import ImageContext
    from linepack.kernel.kallsyms import Kallsyms
    ctx = ImageContext(ElfImage(debian_vmlinux))
    table = Kallsyms()
    table.parse(ctx)
    return ctx, table, table._tokens(ctx)


def _decode(tokens, rec):
    n, pos = rec[0], 1
    if n & 0x80:
        n, pos = (n & 0x7F) | (rec[1] << 7), 2
    assert len(rec) == pos + n
    return b"".join(tokens[b] for b in rec[pos:]).decode("latin-1")


def test_names_round_trip_in_fewest_tokens(kallsyms):
    ctx, table, tokens = kallsyms
    rng = np.random.default_rng(1)
    sample = rng.choice(len(table.names), 3000, replace=False).tolist()
    shorter = 0
    for i in sample:
        text = table.types[i] + table.names[i]
        rec = table.encode_name(tokens, text)
        assert _decode(tokens, rec) == text
        link = table._names_blob[table._record_bounds[i]:table._record_bounds[i + 1]]
        assert len(rec) <= len(link), (text, rec, link)
        shorter += len(rec) < len(link)
        cold = "t" + table.names[i] + ".cold"
        assert _decode(tokens, table.encode_name(tokens, cold)) == cold
    assert shorter < len(sample)          # mostly as the link wrote them


def test_unencodable_name_is_refused(kallsyms):
    _, table, tokens = kallsyms
    with pytest.raises(ValueError, match="token table"):
        table.encode_name(tokens, "tfoo\x01.cold")


def test_add_symbols_appends_records(kallsyms):
    from linepack.kernel.kallsyms import Kallsyms
    ctx, _, tokens = kallsyms
    t = Kallsyms()
    e = t.parse(ctx)
    n = len(e)
    assert t.add_symbols(ctx, ["do_unlinkat.cold", "dput.cold"], ["t", "t"]) == 2
    assert len(t.names) == n + 2 and t.types[-2:] == ["t", "t"]
    for k, want in ((n, "tdo_unlinkat.cold"), (n + 1, "tdput.cold")):
        rec = t._names_blob[t._record_bounds[k]:t._record_bounds[k + 1]]
        assert _decode(tokens, rec) == want


def test_placement_reuses_old_storage():
    from linepack.relayout.kernel.kallsyms_cold import _place
    # Debian 6.1 cloud: offsets | relative_base num_syms | names markers seqs | tokens
    n_old, n_new = 87347, 87777
    old_at = {"kallsyms_offsets": 0x1000, "kallsyms_names": 0x1000 + 4 * n_old + 20}
    old_size = {"kallsyms_offsets": 4 * n_old, "kallsyms_names": 1_180_000,
                "kallsyms_markers": 4 * 342, "kallsyms_seqs_of_names": 3 * n_old}
    old_at["kallsyms_markers"] = old_at["kallsyms_names"] + old_size["kallsyms_names"]
    old_at["kallsyms_seqs_of_names"] = old_at["kallsyms_markers"] + old_size["kallsyms_markers"]
    sizes = {"kallsyms_offsets": 4 * n_new, "kallsyms_names": 1_188_000,
             "kallsyms_markers": 4 * 343, "kallsyms_seqs_of_names": 3 * n_new}
    gap = 0x10_000_000
    at, end = _place(old_at, old_size, sizes, gap)
    # seqs fits the old offsets' slot, names+markers the old names run, offsets the gap
    assert at["kallsyms_seqs_of_names"] == old_at["kallsyms_offsets"]
    assert at["kallsyms_names"] == old_at["kallsyms_names"]
    assert at["kallsyms_markers"] == at["kallsyms_names"] + sizes["kallsyms_names"]
    assert at["kallsyms_offsets"] == gap and end == gap + sizes["kallsyms_offsets"]
    spans = sorted((a, a + sizes[nm]) for nm, a in at.items())
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))
    assert all(a % 8 == 0 for a in at.values())
    # nothing grew: every array stays in the old storage, nothing in the gap
    at, end = _place(old_at, old_size, old_size, gap)
    assert end == gap and all(a < gap for a in at.values())
