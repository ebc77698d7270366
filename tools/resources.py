"""Where linepack's data lives: ``configs/`` and ``workloads/``.

In a checkout (or an editable install) they are the top-level folders beside
``tools/``; a wheel carries a copy inside the package (``linepack/data/``,
written by setup.py's build step), which then wins, so an installed linepack
runs from any directory. $LINEPACK_CONFIGS / $LINEPACK_WORKLOADS override both.
"""

import hashlib
import os

PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__))
CHECKOUT_DIR = os.path.dirname(PACKAGE_DIR)
INSTALLED_DATA = os.path.join(PACKAGE_DIR, "data")
DATA_FOLDERS = ("configs", "workloads")


def data_dir(sub, env=None):
    """The folder ``sub`` (one of DATA_FOLDERS): $env, else the installed copy, else
    the checkout's."""
    if env and os.environ.get(env):
        return os.environ[env]
    installed = os.path.join(INSTALLED_DATA, sub)
    return installed if os.path.isdir(installed) else os.path.join(CHECKOUT_DIR, sub)


def configs_dir():
    """``configs/`` ($LINEPACK_CONFIGS overrides)."""
    return data_dir("configs", "LINEPACK_CONFIGS")


def sources_dir():
    """``workloads/``: the workload programs ($LINEPACK_WORKLOADS overrides)."""
    return data_dir("workloads", "LINEPACK_WORKLOADS")


def source_hash(folders=None, data=()):
    """sha256 (hex) of linepack's own sources (.py, .c, .h, .mk, .toml) under the
    package's ``folders`` (None: all of it) and of the files under ``data`` (paths
    inside configs_dir(), e.g. "relayout"): what a cached result was made by."""
    h = hashlib.sha256()
    roots = [(PACKAGE_DIR, f) for f in (folders or ("",))] + \
        [(configs_dir(), d) for d in data]
    for base, sub in roots:
        top = os.path.join(base, sub)
        for d, dirs, files in sorted(os.walk(top)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".c", ".h", ".mk", ".toml")):
                    path = os.path.join(d, name)
                    h.update(os.path.relpath(path, base).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


__all__ = ["data_dir", "configs_dir", "sources_dir", "source_hash", "DATA_FOLDERS"]
