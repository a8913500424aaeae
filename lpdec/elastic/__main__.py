"""`python -m lpdec.elastic serve --bind HOST:PORT --machines M [--heartbeat_timeout S]`."""

from __future__ import annotations

import argparse
import sys

from lpdec.elastic import service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lpdec.elastic", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run an elastic run's coordinating service")
    serve.add_argument("--bind", default="127.0.0.1:29600", help="host:port to listen on")
    serve.add_argument("--machines", type=int, required=True, help="machine slots")
    serve.add_argument("--heartbeat_timeout", type=int, default=10, help="seconds")
    args = parser.parse_args(argv)
    try:
        service.serve_forever(args.bind, args.machines, heartbeat_timeout=args.heartbeat_timeout)
    except ValueError as error:
        print(f"lpdec.elastic: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
