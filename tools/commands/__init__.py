"""One module per verb; importing this package registers them all with the CLI."""

from . import fetch, verify  # noqa: F401
