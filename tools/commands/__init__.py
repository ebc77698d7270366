"""One module per verb; importing this package registers every verb with the CLI.

Adding a verb = adding a module here that uses ``@verb``; nothing else to edit.
"""

import importlib
import pkgutil

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")
