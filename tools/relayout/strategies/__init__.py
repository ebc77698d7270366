"""Layout strategies: small classes that order and align the units of one region.

Each strategy has ``name`` and ``layout(view, base) -> [(k, address), ...]``
where ``k`` indexes the RegionView's units and ``base`` is the region's new
start. A strategy must place every unit of the view, never below its inferred
alignment (``view.align``), and keep cold units in their original order.

``get(spec, **options)`` builds one from a name (``"pack"``, ``"align-all 64"``,
``"align-all:64"``) or a config mapping (``{"strategy": "pack", ...}``).
"""

from ...errors import LinepackError
from .align_all import AlignAll
from .blocks import Blocks, BlocksExtTsp, BlocksNoPad, BlocksOriginal, BlocksSets
from .hot64 import Hot64
from .pack import Pack
from .stock import Stock

STRATEGIES = {"stock": Stock, "align-all": AlignAll, "hot64": Hot64, "pack": Pack, "blocks": Blocks,
              "blocks-original": BlocksOriginal, "blocks-ext-tsp": BlocksExtTsp,
              "blocks-sets": BlocksSets, "blocks-nopad": BlocksNoPad}


class UnknownStrategy(LinepackError):
    pass


def get(spec, **options):
    if isinstance(spec, dict):
        options = {k: v for k, v in spec.items() if k != "strategy"} | options
        spec = spec.get("strategy", "pack")
    spec = str(spec).strip()
    name, _, arg = spec.replace(":", " ").replace("=", " ").partition(" ")
    name = name.strip().lower().replace("_", "-")
    if name not in STRATEGIES:
        raise UnknownStrategy(f"unknown strategy '{spec}' (known: {', '.join(STRATEGIES)})")
    cls = STRATEGIES[name]
    arg = arg.strip()
    if arg:
        options.setdefault(cls.positional, arg) if getattr(cls, "positional", None) else None
        if not getattr(cls, "positional", None):
            raise UnknownStrategy(f"strategy '{name}' takes no argument (got '{arg}')")
    try:
        return cls(**options)
    except TypeError as e:
        raise UnknownStrategy(f"strategy '{name}': bad options: {e}") from None
