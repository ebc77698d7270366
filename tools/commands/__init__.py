"""One module per verb; ``load_all()`` imports them, which registers every verb with the CLI.

Adding a verb = adding a module here that uses ``@verb``; nothing else to edit. Importing
this package alone registers nothing, so a command line that names its verb imports only
that verb's module (tools/cli.py).
"""

import importlib
import pkgutil


def load_all():
    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{mod}")
