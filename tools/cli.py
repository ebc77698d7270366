"""The ``linepack`` command: thin verbs over profile -> relayout -> verify -> evaluate.

Each verb parses its arguments, calls one function and prints. Expected
failures (LinepackError) become one line on stderr and a distinct exit status.
"""

import argparse
import sys

from . import __version__
from .errors import EXIT_USAGE, LinepackError

VERBS = {}


def verb(name, help_text):
    """Register ``add_arguments(parser)`` / ``run(args)`` pair for a verb."""
    def wrap(cls):
        VERBS[name] = (help_text, cls)
        return cls
    return wrap


def _load_verbs():
    # Each module registers its verb(s) with @verb on import.
    from . import commands  # noqa: F401


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse's usage errors: one line, exit 2, like every other bad input.
        sys.stderr.write(f"linepack: error: {message} (see 'linepack {self.prog.split()[-1]} --help')\n"
                         if " " in self.prog else f"linepack: error: {message}\n")
        sys.exit(EXIT_USAGE)


def build_parser():
    _load_verbs()
    p = _Parser(prog="linepack", description="Post-link code layout for Linux kernels and "
                "x86-64 ELF binaries: profile -> relayout -> verify -> evaluate.")
    p.add_argument("--version", action="version", version=f"linepack {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    for name, (help_text, cls) in VERBS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        cls.add_arguments(sp)
        sp.set_defaults(_run=cls.run)
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args._run(args) or 0)
    except LinepackError as e:
        print(f"linepack: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("linepack: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
