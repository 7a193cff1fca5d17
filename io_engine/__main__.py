"""`python -m io_engine info`: which backend this machine gets, and why (builds the aio op if needed).
`python -m io_engine build-aio`: build DeepSpeed's async_io op now (minutes), so `auto` can pick aio."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m io_engine", description=__doc__)
    parser.add_argument("command", choices=["info", "build-aio"],
                        help="info: report backend availability (builds the aio op if needed); "
                             "build-aio: build the aio op and report (exit 1 if it cannot be built)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from .aio import aio_available

    if args.command == "build-aio":
        start = time.monotonic()
        ok, reason = aio_available(build=True)
        if not ok:
            print(f"aio backend unavailable: {reason}\nthe threads backend does not need this op", file=sys.stderr)
            return 1
        print(f"DeepSpeed async_io op ready ({time.monotonic() - start:.0f} s); backend 'auto' selects aio")
        return 0
    ok, reason = aio_available()
    print(f"aio backend:     {'available (libaio via DeepSpeed async_io)' if ok else 'unavailable: ' + reason}")
    print("threads backend: available")
    print(f"auto selects:    {'aio' if ok else 'threads'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
