"""`python -m io_engine info`: which backend this machine gets, and why."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m io_engine", description=__doc__)
    parser.add_argument("command", choices=["info"], help="info: report backend availability (builds the aio op if needed)")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from .aio import aio_available

    ok, reason = aio_available()
    print(f"aio backend:     {'available (libaio via DeepSpeed async_io)' if ok else 'unavailable: ' + reason}")
    print("threads backend: available")
    print(f"auto selects:    {'aio' if ok else 'threads'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
