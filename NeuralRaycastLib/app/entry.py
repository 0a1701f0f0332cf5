"""The ``neuralraycast`` command's entry point. Loading the command line takes a moment (numpy, the package);
a Ctrl-C meanwhile exits with status 130 and one line, as it does once a command runs, not a traceback."""

from __future__ import annotations

import signal
import sys


def _interrupted(signum, frame) -> None:
    print("neuralraycast: cancelled", file=sys.stderr)
    raise SystemExit(130)


def main(argv: list[str] | None = None) -> int:
    previous = signal.signal(signal.SIGINT, _interrupted)
    from .cli import main as run_command

    signal.signal(signal.SIGINT, previous)  # the command's own handling (CancelOnInterrupt) from here on
    return run_command(argv)


if __name__ == "__main__":
    sys.exit(main())
