"""`python -m lpdec.elastic serve|credentials ...`: an elastic run's service, its credentials.

python -m lpdec.elastic credentials DIR --machines M [--days D] [--token_file F]
python -m lpdec.elastic serve --bind HOST:PORT --machines M [--credentials DIR]
    [--private_network] [--heartbeat_timeout S]
"""

from __future__ import annotations

import argparse
import sys

from lpdec.elastic import credentials
from lpdec.elastic import service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lpdec.elastic", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run an elastic run's coordinating service")
    serve.add_argument("--bind", default="127.0.0.1:29600", help="host:port to listen on")
    serve.add_argument("--machines", type=int, required=True, help="machine slots")
    serve.add_argument("--heartbeat_timeout", type=int, default=10, help="seconds")
    serve.add_argument("--credentials", help="the run's credentials directory (mutual TLS)")
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
            token = None
            if args.token_file:
                try:
                    with open(args.token_file, "rb") as f:
                        token = f.read().strip()
                except OSError as error:
                    raise ValueError(
                        f"--token_file={args.token_file!r}: {error.strerror}"
                    ) from None
            prefix = credentials.make(args.directory, args.machines, days=args.days, token=token)
            print(
                f"lpdec.elastic: credentials for {args.machines} machines in {args.directory} "
                f"(peer prefix {prefix}); give each machine ca.pem and its machine-<m>*.pem, "
                "the service ca.pem and service*.pem; keep ca-key.pem elsewhere"
            )
            return 0
        creds = credentials.load(args.credentials, "service") if args.credentials else None
        service.serve_forever(
            args.bind,
            args.machines,
            heartbeat_timeout=args.heartbeat_timeout,
            credentials=creds,
            private_network=args.private_network,
        )
    except ValueError as error:
        print(f"lpdec.elastic: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
