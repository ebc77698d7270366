"""The block map: where every original basic block (and every branch the
block-level relayout re-encoded) went.

A block-level relayout writes it into its output as the non-allocated section
``.linepack.blockmap`` so that ``verify --against`` can check the rewrite
block by block without re-planning it. Function-level layouts do not write it.

Section contents (little endian):

    header  16 bytes: b"LPBM", u32 version (1), u32 rows, u32 flags
            (FLAG_NO_PADDING: the layout was asked to drop prefix paddings that
            call-depth tracking may patch, ``prefix_padding = "none"``; else 0)
    rows    ``rows`` records of BLOCKMAP_ROW (32 bytes each), sorted by
            (old, old_len): a zero-length row sorts before the block at the
            same address.

Row fields:
    old      u64  original address of the piece
    new      u64  new address of the piece
    old_len  u32  bytes at ``old`` in the original
    new_len  u32  bytes at ``new`` in the output
    func     u32  symbol-table index of the function the piece belongs to, in the
                  ORIGINAL image (the output inserts `name.cold` locals before the
                  globals, so a global's index there is larger by the number of
                  .cold symbols; look the function up by name in the output)
    kind     u8   KIND_COPIED, KIND_BRANCH, KIND_JMP_INSERTED, KIND_JMP_REMOVED,
                  KIND_PAD_DROPPED
    part     u8   PART_HOT (the function's main part, at its symbol) or PART_COLD
                  (the ``name.cold`` part)

Kinds:
    KIND_COPIED (0)        bytes copied; only address fields (relocated or
                           assembler-resolved references) may differ;
                           old_len == new_len.
    KIND_BRANCH (1)        one direct jmp/jcc (or a static-key site) re-encoded;
                           old_len/new_len are the instruction lengths
                           (2 or 5/6); its target is the map of the old target.
    KIND_JMP_INSERTED (2)  a ``jmp`` appended because the split broke a
                           fall-through: ``old`` is the fall-through target's
                           original address, old_len 0, ``new``/``new_len`` the
                           inserted jmp.
    KIND_JMP_REMOVED (3)   an unconditional jmp to the block now placed next
                           disappeared: ``old``/``old_len`` the jmp, new_len 0,
                           ``new`` the address where its target now starts.
    KIND_PAD_DROPPED (4)   the front of a function's prefix padding (single-byte
                           NOPs before its entry) that the layout did not keep
                           (call-depth tracking needs only its thunk template's
                           size of it: kernel/prefixes.py): ``old``/``old_len`` the
                           dropped NOPs, new_len 0, ``new`` where the kept padding
                           now starts.

The pieces of a function tile its original bytes exactly (kind 2 rows take no
original bytes); nothing outside split functions appears in the map (whole
moved functions are described by the symbol tables, as for function-level
layouts).
"""

import numpy as np

from ..errors import BadInput

SECTION_NAME = ".linepack.blockmap"
MAGIC = b"LPBM"
VERSION = 1

KIND_COPIED, KIND_BRANCH, KIND_JMP_INSERTED, KIND_JMP_REMOVED, KIND_PAD_DROPPED = 0, 1, 2, 3, 4
KIND_NAMES = {KIND_COPIED: "copied", KIND_BRANCH: "branch", KIND_JMP_INSERTED: "jmp-inserted",
              KIND_JMP_REMOVED: "jmp-removed", KIND_PAD_DROPPED: "padding-dropped"}
PART_HOT, PART_COLD = 0, 1

FLAG_NO_PADDING = 1
HEADER = np.dtype([("magic", "S4"), ("version", "<u4"), ("rows", "<u4"), ("flags", "<u4")])
BLOCKMAP_ROW = np.dtype([
    ("old", "<u8"), ("new", "<u8"), ("old_len", "<u4"), ("new_len", "<u4"),
    ("func", "<u4"), ("kind", "u1"), ("part", "u1"), ("pad", "u1", 2)])
assert HEADER.itemsize == 16 and BLOCKMAP_ROW.itemsize == 32


def empty(n=0):
    """A zeroed row array of length n."""
    return np.zeros(n, BLOCKMAP_ROW)


def make_rows(old, old_len, new, new_len, kind, part, func):
    """A sorted row array from parallel arrays (any integer dtype)."""
    rows = empty(len(old))
    rows["old"], rows["old_len"] = old, old_len
    rows["new"], rows["new_len"] = new, new_len
    rows["kind"], rows["part"], rows["func"] = kind, part, func
    return sort_rows(rows)


def sort_rows(rows):
    order = np.lexsort((rows["old_len"], rows["old"]))
    return rows[order]


def check_rows(rows):
    """Problems with a row array as a list of strings (empty when well formed):
    sort order, lengths per kind, overlapping original pieces."""
    bad = []
    if not len(rows):
        return bad
    old = rows["old"].astype(np.uint64)
    if (np.diff(old.astype(np.int64)) < 0).any():
        bad.append("rows not sorted by old address")
    k = rows["kind"]
    if (k > KIND_PAD_DROPPED).any():
        bad.append(f"{int((k > KIND_PAD_DROPPED).sum())} rows of unknown kind")
    copied = k == KIND_COPIED
    if (rows["old_len"][copied] != rows["new_len"][copied]).any():
        bad.append("copied rows with old_len != new_len")
    if (rows["old_len"][k == KIND_JMP_INSERTED] != 0).any():
        bad.append("inserted-jmp rows with old_len != 0")
    if (rows["new_len"][k == KIND_JMP_REMOVED] != 0).any():
        bad.append("removed-jmp rows with new_len != 0")
    if (rows["new_len"][k == KIND_PAD_DROPPED] != 0).any():
        bad.append("dropped-padding rows with new_len != 0")
    span = rows[rows["old_len"] > 0]
    if len(span) > 1:
        end = span["old"][:-1] + span["old_len"][:-1].astype(np.uint64)
        ov = end > span["old"][1:]
        if ov.any():
            bad.append(f"{int(ov.sum())} original pieces overlap the next one "
                       f"(first at {int(span['old'][:-1][ov][0]):#x})")
    return bad


def to_bytes(rows, flags=0):
    """Section contents for a (sorted) row array (``flags``: the header's)."""
    rows = np.ascontiguousarray(rows, dtype=BLOCKMAP_ROW)
    head = np.zeros(1, HEADER)
    head["magic"], head["version"], head["rows"] = MAGIC, VERSION, len(rows)
    head["flags"] = flags
    return head.tobytes() + rows.tobytes()


def from_bytes(data, what=SECTION_NAME):
    """Row array from section contents; BadInput on a malformed section."""
    buf = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else data
    if len(buf) < HEADER.itemsize:
        raise BadInput(f"{what}: truncated block map header")
    head = np.frombuffer(bytes(buf[:HEADER.itemsize]), HEADER)[0]
    if bytes(head["magic"]) != MAGIC:
        raise BadInput(f"{what}: not a linepack block map (bad magic)")
    if int(head["version"]) != VERSION:
        raise BadInput(f"{what}: block map version {int(head['version'])}, expected {VERSION}")
    n = int(head["rows"])
    need = HEADER.itemsize + n * BLOCKMAP_ROW.itemsize
    if len(buf) < need:
        raise BadInput(f"{what}: block map truncated ({len(buf)} bytes, {n} rows need {need})")
    return np.frombuffer(bytes(buf[HEADER.itemsize:need]), BLOCKMAP_ROW).copy()


def read_blockmap(image):
    """Row array of an ElfImage's ``.linepack.blockmap``, or None when it has none."""
    sec = image.section(SECTION_NAME)
    if sec is None:
        return None
    return from_bytes(image.section_bytes(sec), f"{image.path}: {SECTION_NAME}")


def read_flags(image):
    """The header flags of an ElfImage's ``.linepack.blockmap`` (0 without one)."""
    sec = image.section(SECTION_NAME)
    if sec is None:
        return 0
    data = bytes(image.section_bytes(sec)[:HEADER.itemsize])
    if len(data) < HEADER.itemsize or data[:4] != MAGIC:
        return 0
    return int(np.frombuffer(data, HEADER)[0]["flags"])


def address_map(rows, extents=(), anchors=None, base=None):
    """An AddressMap with one piece per row that takes original bytes.

    Copied bytes map linearly; every address inside a re-encoded branch maps
    to the branch's new start (its end to the branch's new end); every address
    of a removed jmp maps to where its target now is. Inserted jmps take no
    original bytes and so are not pieces. ``base``: an AddressMap (e.g. the
    function-level map of the same layout) whose pieces the rows replace where
    they overlap.
    """
    from .addrmap import AddressMap
    r = rows[rows["old_len"] > 0]
    old = r["old"].astype(np.uint64)
    old_end = old + r["old_len"].astype(np.uint64)
    new = r["new"].astype(np.uint64)
    new_end = new + r["new_len"].astype(np.uint64)
    collapse = r["kind"] != KIND_COPIED
    if base is not None and len(base):
        # Keep the base pieces no row overlaps (functions moved whole).
        lo = np.searchsorted(old, base.old_start, side="left")
        hi = np.searchsorted(old, base.old_end, side="left")
        prev_end = np.where(lo > 0, old_end[np.maximum(lo - 1, 0)], 0) if len(old) else \
            np.zeros(len(base), np.uint64)
        keep = (hi == lo) & ~(prev_end > base.old_start) if len(old) else np.ones(len(base), bool)
        b_new_end = base.new_end if base.new_end is not None else \
            base.new_start + (base.old_end - base.old_start)
        old = np.concatenate([old, base.old_start[keep]])
        old_end = np.concatenate([old_end, base.old_end[keep]])
        new = np.concatenate([new, base.new_start[keep]])
        new_end = np.concatenate([new_end, b_new_end[keep]])
        bc = base.collapse if base.collapse is not None else np.zeros(len(base), bool)
        collapse = np.concatenate([collapse, bc[keep]])
        ext = list(zip(base.ext_lo.tolist(), base.ext_hi.tolist())) + list(extents)
        anc = dict(zip(base.anchor_old.tolist(), base.anchor_new.tolist()))
        anc.update(anchors or {})
        extents, anchors = ext, anc
    return AddressMap(old, old_end, new, extents, anchors, new_end=new_end, collapse=collapse)


def summary(rows):
    """Counts per kind and part, and bytes, for reports."""
    out = {"rows": int(len(rows))}
    for k, name in KIND_NAMES.items():
        out[name.replace("-", "_")] = int((rows["kind"] == k).sum())
    out["functions"] = int(len(np.unique(rows["func"]))) if len(rows) else 0
    out["cold_bytes"] = int(rows["new_len"][rows["part"] == PART_COLD].sum())
    out["hot_bytes"] = int(rows["new_len"][rows["part"] == PART_HOT].sum())
    return out
