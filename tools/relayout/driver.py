"""relayout(): the one function the verb calls (its passes: relayout/passes.py),
and reading a profile for it."""

import json
import os

from ..errors import BadInput
from ..image.elf import ElfImage
from ..image.context import ImageContext
from . import strategies
from .passes import (MISSING_SHARE, NO_RELOCS, RelayoutRun, check_paths, check_profile,
                     passes_for, run_passes)

__all__ = ["LoadedProfile", "MISSING_SHARE", "NO_RELOCS", "check_profile", "load_profile",
           "load_profile_full", "relayout"]


def _read_profile(path):
    """(JSON document, None) for the simple form, (None, Profile) for the model."""
    if not os.path.exists(path):
        raise BadInput(f"{path}: no such profile")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("functions"), dict):
        return doc, None
    try:   # the project's profile model
        from ..profile.model import Profile
        return None, Profile.load(path)
    except Exception as e:   # noqa: BLE001
        why = str(e)
        why = why[len(path) + 2:] if why.startswith(f"{path}: ") else why
        raise BadInput(f"{path}: not a profile (expected the profile model or "
                       f"{{\"functions\": {{name: count}}}}): {why}") from None


def function_hotness(prof):
    """{key: count} of a profile's functions with a nonzero count: a global function
    by name, a local one by its start address (``"0x..."``). Static functions share
    names (``pmd_val``, ``p4d_offset``, ``put_page``: dozens each in a kernel), and a
    name reaches only the first function of that name (Functions.index_of); the
    profile's address is exact (it was recorded for this build)."""
    c = prof.counts().tolist()
    local = prof.func_local.astype(bool).tolist() if len(prof.func_local) else \
        [False] * len(c)
    out = {}
    for n, a, is_local, v in zip(prof.func_name, prof.func_addr.tolist(), local, c):
        if v:
            k = f"{int(a):#x}" if is_local else n
            out[k] = out.get(k, 0) + v
    return out


def _hotness(doc, prof, per_loop):
    """(hotness {name or address: count}, build_id, calls by name) from either form."""
    if prof is None:
        return ({k: float(v) for k, v in doc["functions"].items()}, doc.get("build_id"),
                doc.get("calls") or [])
    counts = function_hotness(prof)
    loops = prof.meta.get("loops")
    if per_loop and loops:
        # Counts per workload iteration: min_count 1 = "runs once per iteration".
        counts = {k: v / float(loops) for k, v in counts.items()}
    return counts, prof.meta.get("build_id"), []


def load_profile(path, per_loop=True):
    """{function name or address: count}, build-id and call edges from a profile file.

    Accepts the simple JSON form ``{"functions": {"name": count}}`` (optionally
    ``"build_id"``, ``"calls": [[caller, callee, count], ...]``), or the
    project's profile model.
    """
    return _hotness(*_read_profile(path), per_loop)


class LoadedProfile:
    """What a layout needs from a profile: hotness, call edges, executed blocks."""

    def __init__(self, hotness, build_id=None, calls=(), blocks=None, profile=None):
        self.hotness, self.build_id = hotness, build_id
        self.calls, self.blocks, self.profile = list(calls or ()), blocks, profile


def load_profile_full(path, image=None, per_loop=True):
    """load_profile plus, for the profile model, call edges and blocks.

    Call edges need the image's functions (``image``: a path or ElfImage); the
    pack strategy uses them for affinity ordering and the blocks to place small
    functions by their executed bytes.
    """
    doc, prof = _read_profile(path)
    hot, build_id, calls = _hotness(doc, prof, per_loop)
    if prof is None:          # the simple JSON form has no blocks or edges
        return LoadedProfile(hot, build_id, calls)
    from .plan import profile_blocks, profile_calls
    if image is not None:
        from ..image.shared import elf_image
        # the shared object: relayout() opens the same path next (parsed once)
        im = image if isinstance(image, ElfImage) else elf_image(image)
        calls = profile_calls(prof, ImageContext.of(im).functions, per_loop=per_loop)
    from .block_order import executed_blocks
    return LoadedProfile(hot, build_id, calls, executed_blocks(prof, profile_blocks(prof)), prof)


def relayout(image_path, out_path, strategy="pack", hotness=None, calls=(), profile_build_id=None,
             log=None, debug="rewrite", layout_map=None, system_map=None, blocks=None,
             allow_missing=False, vmlinuz=None, keep_instructions=False):
    """Lay out ``image_path`` per ``strategy`` and write ``out_path``; returns
    (summary, plan, rewriter). The summary is the JSON dict, with the passes'
    stats objects in ``summary.stats`` (``summary.lines()`` prints them).
    ``debug``: "rewrite" the DWARF for the new layout (default) or "strip" it.
    ``keep_instructions``: the rewriter keeps its disassembly and CFG instruction
    arrays (else released before the DWARF rewrite, to save memory; same output)."""
    if debug not in ("rewrite", "strip"):
        raise ValueError(f"debug={debug!r}: expected 'rewrite' or 'strip'")
    check_paths(image_path, out_path)
    strat = strategies.get(strategy) if not hasattr(strategy, "layout") else strategy
    run = RelayoutRun(image_path, out_path, strat, hotness or {}, calls=calls,
                      profile_build_id=profile_build_id, blocks=blocks,
                      log=log or (lambda m: None), debug=debug, layout_map=layout_map,
                      system_map=system_map, allow_missing=allow_missing, vmlinuz=vmlinuz)
    summary = run_passes(run, passes_for(strat, keep_instructions))
    return summary, run.plan, run.rewriter


