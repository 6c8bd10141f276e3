"""Refusing bad command-line input: one line, `splitserve COMMAND: reason`, on stderr and exit
status 2 (argparse's own for a usage error), before the command starts its real work.

Contract:

- A command reads and checks its inputs (options, files, a config and its validation, a model
  to resolve) inside `with refusing("COMMAND"):`. A ValueError or OSError raised there leaves
  the block as `Refused`, chained to it; a refusal the command decides itself is
  `raise Refused("COMMAND", reason)`.
- `splitserve.cli.main` catches `Refused` once, prints its line (`refuse`) and returns 2.
- What a command does after that block (starting workers, measuring, serving) is outside it:
  its errors, ValueError and OSError included, keep their type and traceback. A command that
  is pure computation on its inputs (`sim`, `plan`) may be in the scope whole, with
  `@refusing("COMMAND")` over it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_REFUSED = 2  # argparse's exit status for a usage error
INPUT_ERRORS: tuple[type[Exception], ...] = (ValueError, OSError)


class Refused(Exception):
    """`command`'s input refused because of `why` (an exception or a message); its text is
    the line `refuse` prints."""

    def __init__(self, command: str, why: object) -> None:
        super().__init__(f"splitserve {command}: {why}")
        self.command, self.why = command, why


def refuse(command: str, why: object) -> int:
    """Print `splitserve COMMAND: why` on stderr; return the exit status 2."""
    print(Refused(command, why), file=sys.stderr, flush=True)
    return EXIT_REFUSED


@contextmanager
def refusing(command: str, *also: type[Exception]) -> Iterator[None]:
    """The input phase of `command`: a ValueError or OSError (or one of `also`) raised in the
    block becomes `Refused(command, exc)`. Anything else, `Refused` included, passes
    unchanged. As a decorator, the whole function is the input phase."""
    try:
        yield
    except (*INPUT_ERRORS, *also) as exc:
        raise Refused(command, exc) from exc
