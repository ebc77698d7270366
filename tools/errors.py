"""Errors a user can cause, each with one clear line and a distinct exit status."""

# Exit statuses shared by every verb.
EXIT_OK = 0
EXIT_FINDINGS = 1      # verify found problems
EXIT_USAGE = 2         # bad arguments or unreadable / unsuitable input
EXIT_EXTERNAL = 3      # a tool we drive (QEMU, apt-get, compiler) failed


class LinepackError(Exception):
    """An expected failure: printed as one line, never as a traceback."""

    exit_code = EXIT_USAGE

    def __init__(self, message, exit_code=None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class BadInput(LinepackError):
    """The input file is missing, unreadable or not what the verb needs."""


class ExternalToolError(LinepackError):
    """A program linepack drives failed or is missing."""

    exit_code = EXIT_EXTERNAL
