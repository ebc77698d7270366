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


def _check_placement(at, sizes, old_storage, gap, end, fixed):
    """No two arrays overlap, none overlaps a fixed one (num_syms, relative_base),
    each lies in the old storage or in [gap, end)."""
    spans = sorted((a, a + sizes[nm], nm) for nm, a in at.items())
    assert all(b <= c for (_, b, _), (c, _, _) in zip(spans, spans[1:])), spans
    for a, b, nm in spans:
        assert all(b <= lo or a >= hi for lo, hi in fixed), nm
        assert (gap <= a and b <= end) or any(lo <= a and b <= hi for lo, hi in old_storage), nm


def test_placement_6_12_order_moves_the_tokens():
    """Debian 13's 6.12 (scripts/kallsyms.c order): num_syms | names markers |
    token_table token_index | offsets | relative_base | seqs_of_names. The tokens
    move so names..offsets is one area; relative_base stays, so seqs_of_names
    (3 bytes a symbol) is all that goes to the gap (was: all of kallsyms_names)."""
    from linepack.relayout.kernel.kallsyms_cold import _place
    n_old, n_new = 157922, 158107
    names_at, names_size = 0x82151f68, 0x82366fd0 - 0x82151f68 - 4
    old_at = {"kallsyms_names": names_at, "kallsyms_markers": 0x82366fd0,
              "kallsyms_offsets": 0x82367f78, "kallsyms_seqs_of_names": 0x82402308}
    old_size = {"kallsyms_names": names_size, "kallsyms_markers": 4 * 617,
                "kallsyms_offsets": 4 * n_old, "kallsyms_seqs_of_names": 3 * n_old}
    sizes = {"kallsyms_names": names_size + 185 * 11, "kallsyms_markers": 4 * 618,
             "kallsyms_offsets": 4 * n_new, "kallsyms_seqs_of_names": 3 * n_new,
             "kallsyms_token_table": 0x400, "kallsyms_token_index": 0x200}
    gap = 0x82ac1df0
    at, end = _place(old_at, old_size, {k: v for k, v in sizes.items() if k in old_at}, gap,
                     tokens=(0x82367978, 0x600))
    assert at["kallsyms_seqs_of_names"] == gap and end == gap + 3 * n_new
    assert at["kallsyms_token_table"] != 0x82367978
    assert at["kallsyms_token_index"] == at["kallsyms_token_table"] + 0x400
    assert at["kallsyms_names"] == names_at
    _check_placement(at, sizes, [(names_at, 0x82402300), (0x82402308, 0x82402308 + 3 * n_old)],
                     gap, end, [(0x82151f60, names_at), (0x82402300, 0x82402308)])


def test_placement_7_3_order_leaves_only_markers_for_the_gap():
    """trixie-backports' 7.3: num_syms | names markers | token_table token_index |
    offsets seqs_of_names, no relative_base. With the tokens moved the old storage
    is one area; the growth (~2 KB for 113 .cold entries) needs one small array
    out of it: kallsyms_markers (3 KB) goes to the gap, not seqs_of_names
    (593 KB) or the names (3.2 MB, as before)."""
    from linepack.relayout.kernel.kallsyms_cold import _place
    n_old, n_new = 197553, 197666
    names_at = 0x8239f764                      # 4-aligned: after the u32 num_syms
    old_at = {"kallsyms_names": names_at, "kallsyms_markers": 0x826b0780,
              "kallsyms_offsets": 0x826b19e8, "kallsyms_seqs_of_names": 0x826b19e8 + 4 * n_old}
    old_size = {"kallsyms_names": 0x826b0780 - names_at, "kallsyms_markers": 4 * 772,
                "kallsyms_offsets": 4 * n_old, "kallsyms_seqs_of_names": 3 * n_old}
    sizes = {"kallsyms_names": old_size["kallsyms_names"] + 1496, "kallsyms_markers": 4 * 773,
             "kallsyms_offsets": 4 * n_new, "kallsyms_seqs_of_names": 3 * n_new,
             "kallsyms_token_table": 0x458, "kallsyms_token_index": 0x200}
    gap = 0x82f67b48
    at, end = _place(old_at, old_size, {k: v for k, v in sizes.items() if k in old_at}, gap,
                     tokens=(0x826b1390, 0x658))
    assert at["kallsyms_names"] == names_at     # stays at the link's (4-byte) alignment
    assert at["kallsyms_markers"] == gap and end == gap + sizes["kallsyms_markers"]
    assert at["kallsyms_token_index"] == at["kallsyms_token_table"] + 0x458
    old_end = old_at["kallsyms_seqs_of_names"] + 3 * n_old
    _check_placement(at, sizes, [(names_at, old_end)], gap, end, [(0x8239f760, names_at)])


def test_dropped_prefix_sorts_after_its_function(kallsyms):
    """A prefix whose padding a layout dropped whole (prefix_padding = "none") sits at
    its function's entry: ``__pfx_<fn>`` sorts after ``<fn>`` there, so that backtraces
    name the function, even where the underscore rule alone would put the prefix first
    (``___slab_alloc``: 3 leading underscores, ``__pfx_``: 2); a prefix tied with
    another name keeps the usual order."""
    from linepack.image.addrmap import AddressMap
    from linepack.kernel.kallsyms import Kallsyms
    ctx, _, _ = kallsyms
    t = Kallsyms()
    e = t.parse(ctx)
    n = len(e)
    fn = ctx.image.symbol_address("___slab_alloc")
    other = ctx.image.symbol_address("____fput")
    t.add_symbols(ctx, ["__pfx____slab_alloc", "__pfx_not_fput"], ["t", "t"])
    ident = AddressMap(np.array([0], np.uint64), np.array([2 ** 64 - 1], np.uint64),
                       np.array([0], np.uint64))
    out = t.update(ctx, e, ident, extra_addr=[fn, other])
    order = out["old_index"].tolist()
    own = t.names.index("___slab_alloc")
    assert order.index(own) < order.index(n)
    fput = t.names.index("____fput")
    assert order.index(n + 1) < order.index(fput)      # not its own: fewer underscores first
