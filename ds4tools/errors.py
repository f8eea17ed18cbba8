"""The project's error classes: one line that names the file and the problem, and an exit code.

Library code raises these (they are ``ValueError`` subclasses, so callers that only know the
standard library still catch them); the command line prints ``ds4tools: <message>`` to stderr
and exits with ``exit_code``:

- ``InvalidContentError`` (1): the input was read, but what it holds breaks a rule (a tensor
  outside the file, a NaN in the weights, an unsupported architecture...).
- ``UnreadableError`` (2): the input cannot be read as what it claims to be (not a GGUF file,
  a truncated header, a missing shard...).
- ``UsageError`` (2): the request itself is wrong (an unknown type name, an output that exists).
"""
from __future__ import annotations

import os


class Ds4Error(ValueError):
    exit_code: int = 1

    def __init__(self, message: str, exit_code: int | None = None, *, findings=None):
        # One line, always: a multi-line message would break "one clear line" for the user.
        message = " ".join(str(message).split("\n")).strip()
        super().__init__(message)
        self.message = message
        if exit_code is not None:
            self.exit_code = int(exit_code)
        #: every problem found, when there were several (the message names the first)
        self.findings: list[str] = list(findings) if findings else [message]

    def __str__(self) -> str:
        return self.message


class InvalidContentError(Ds4Error):
    exit_code = 1


class UnreadableError(Ds4Error):
    exit_code = 2


class UsageError(Ds4Error):
    exit_code = 2


def about(path, problem: str) -> str:
    """``<path>: <problem>``, the shape of every message."""
    return f"{os.fspath(path)}: {problem}"
