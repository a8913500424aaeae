"""`python -m lpdec.elastic serve|credentials ...`: an elastic run's service, its credentials.

python -m lpdec.elastic credentials DIR --machines M [--days D] [--token_file F]
python -m lpdec.elastic serve --bind HOST:PORT --machines M [--token_file F]
    [--credentials DIR] [--private_network] [--heartbeat_timeout S] [--linger S]

`serve` needs the run's token (--token_file, or LPDEC_ELASTIC_TOKEN): its gate lets
in only machines that prove it.
"""

from __future__ import annotations

import argparse
import os
import sys

from lpdec.elastic import credentials
from lpdec.elastic import service


def _read_token(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read().strip()
    except OSError as error:
        raise ValueError(f"--token_file={path!r}: {error.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lpdec.elastic", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run an elastic run's coordinating service")
    serve.add_argument("--bind", default="127.0.0.1:29600", help="host:port to listen on")
    serve.add_argument("--machines", type=int, required=True, help="machine slots")
    serve.add_argument("--heartbeat_timeout", type=int, default=10, help="seconds")
    serve.add_argument(
        "--token_file", help="the run's token (default: LPDEC_ELASTIC_TOKEN); required"
    )
    serve.add_argument("--credentials", help="the run's credentials directory (mutual TLS)")
    serve.add_argument(
        "--linger",
        type=float,
        default=10.0,
        help="seconds the service stays up after a machine says the run has finished "
        "(< 0: until SIGTERM)",
    )
    serve.add_argument(
        "--private_network",
        action="store_true",
        help="serve off loopback without credentials (only the run's machines reach it)",
    )
    make = sub.add_parser("credentials", help="make a run's CA and certificates in DIR")
    make.add_argument("directory")
    make.add_argument("--machines", type=int, required=True, help="machine slots")
    make.add_argument("--days", type=int, default=365, help="days the certificates are valid")
    make.add_argument(
        "--token_file", help="the run's token: a machine with another stops before it registers"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "credentials":
            token = _read_token(args.token_file) if args.token_file else None
            prefix = credentials.make(args.directory, args.machines, days=args.days, token=token)
            print(
                f"lpdec.elastic: credentials for {args.machines} machines in {args.directory} "
                f"(peer prefix {prefix}); give each machine ca.pem and its machine-<m>*.pem, "
                "the service ca.pem and service*.pem; keep ca-key.pem elsewhere"
            )
            return 0
        token = (
            _read_token(args.token_file)
            if args.token_file
            else os.environ.get("LPDEC_ELASTIC_TOKEN", "").encode()
        )
        creds = credentials.load(args.credentials, "service") if args.credentials else None
        service.serve_forever(
            args.bind,
            args.machines,
            token=token,
            heartbeat_timeout=args.heartbeat_timeout,
            credentials=creds,
            private_network=args.private_network,
            linger=args.linger,
        )
    except ValueError as error:
        print(f"lpdec.elastic: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
