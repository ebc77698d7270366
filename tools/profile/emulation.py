"""How much of a profile is the emulated machine rather than the workload.

Under QEMU TCG some kernel paths run far more (or far less) than on hardware: an
RNG that was never seeded re-extracts its entropy pool on every request, timer
ticks come at emulated rather than real instruction rates, legacy port I/O is
everywhere. ``configs/emulation.toml`` names the code of each such category by
regular expressions over function names; :func:`emulation_shares` sums a
profile's instructions (or its own metric) per category::

    shares = emulation_shares(Profile.load("vfs-mix.prof"))
    shares.share("rng")          # fraction of all counted instructions
    shares.lines()               # human summary (``linepack profile --show``)
"""

import os
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import BadInput
from ..io import load_toml
from . import workloads as _workloads

# Compiler-made clones and split parts belong to the function they came from.
_SUFFIX = re.compile(r"(\.(constprop|part|isra|cold|lto_priv|localalias)(\.\d+)?)+$")


def base_name(name):
    """``name`` without gcc's clone suffixes (``foo.part.0.constprop.0`` -> ``foo``)."""
    return _SUFFIX.sub("", name)


def load_categories(path=None):
    """{category: compiled regex} from configs/emulation.toml (or ``path``), in file order."""
    path = path or os.path.join(_workloads.configs_dir(), "emulation.toml")
    data = load_toml(path)
    cats = {}
    for cat, pats in data.items():
        if not isinstance(pats, list) or not all(isinstance(p, str) for p in pats):
            raise BadInput(f"{path}: category '{cat}' must be a list of regular expressions")
        try:
            cats[cat] = re.compile("(?:" + "|".join(f"(?:{p})" for p in pats) + r")\Z")
        except re.error as e:
            raise BadInput(f"{path}: category '{cat}': bad regular expression: {e}") from None
    return cats


@dataclass
class EmulationShares:
    metric: str
    total: int                                        # all counted (incl. outside functions)
    counts: dict = field(default_factory=dict)        # category -> count
    functions: dict = field(default_factory=dict)     # category -> [(name, count)] hottest first

    def share(self, category=None):
        """Fraction of ``total`` in ``category`` (None: all categories together)."""
        c = sum(self.counts.values()) if category is None else self.counts.get(category, 0)
        return c / self.total if self.total else 0.0

    def lines(self, top=3):
        out = [f"  emulation-attributable code (configs/emulation.toml), share of {self.total:,} "
               f"{self.metric}: {100 * self.share():.2f}%"]
        for cat, c in self.counts.items():
            hot = ", ".join(f"{n} {100 * v / self.total:.2f}%" for n, v in self.functions[cat][:top])
            out.append(f"    {cat:<17} {100 * c / max(self.total, 1):6.2f}%"
                       + (f"  ({hot})" if hot else ""))
        return out

    def as_dict(self):
        return {"metric": self.metric, "total": self.total,
                "share": self.share(), "categories": {
                    c: {"count": v, "share": self.share(c),
                        "top": [[n, x] for n, x in self.functions[c][:5]]}
                    for c, v in self.counts.items()}}


def emulation_shares(profile, categories=None, metric=None):
    """Per-category counts of ``profile`` (its own metric unless ``metric`` is given).

    The denominator is everything the profile counted with that metric, including
    counts outside every function (``meta["unmapped"]``, QEMU profiles).
    """
    cats = categories if categories is not None else load_categories()
    metric = metric or profile.metric
    counts = profile.counts(metric).astype(np.uint64)
    total = int(counts.sum())
    if metric == "insns" and profile.meta.get("instructions"):
        total = max(total, int(profile.meta["instructions"]))
    res = EmulationShares(metric=metric, total=total)
    names = [base_name(n) for n in profile.func_name]
    for cat, rx in cats.items():
        hits = [(profile.func_name[i], int(counts[i])) for i, n in enumerate(names)
                if counts[i] and rx.match(n)]
        hits.sort(key=lambda t: (-t[1], t[0]))
        res.counts[cat] = sum(v for _, v in hits)
        res.functions[cat] = hits
    return res
