"""Small shared I/O: atomic, reproducible output files and TOML configs."""

import contextlib
import os
import tempfile

from .errors import BadInput


@contextlib.contextmanager
def atomic_output(path, mode=0o644):
    """Open a temp file beside ``path`` for binary writing; rename it into place
    when the block succeeds, delete it when it fails (never a half-written file)."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_atomic(path, data, mode=0o644):
    """Write bytes (or str, as UTF-8) to path via a temp file + rename."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_output(path, mode) as f:
        f.write(data)


def load_toml(path):
    """A TOML file as a dict; one clear BadInput line when missing or malformed."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise BadInput("reading TOML needs Python >= 3.11 or the 'tomli' package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{path}: bad TOML: {e}") from None
