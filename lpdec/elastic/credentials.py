"""An elastic run's credentials: mutual TLS between its service and its machines.

    python -m lpdec.elastic credentials DIR --machines 3

makes, in DIR, a certificate authority for this run alone and a certificate
for the service and for each machine slot, each naming its role in a URI
subject alternative name under the run's prefix (``lpdec://run-<id>/``):

    ca.pem                         the run's CA certificate (every party needs it)
    ca-key.pem                     the CA's key: only to issue more; keep it off the machines
    service.pem, service-key.pem   the coordinating service's
    machine-<m>.pem, machine-<m>-key.pem   machine slot m's
    run.json                       the run id, the peer prefix, the slot count

jax's coordination service (from jax 0.11.2: the `mtls_*` arguments of
`jax.distributed.initialize`) then accepts a connection only from a peer whose
certificate the run's CA signed and whose URI SAN starts with the run's prefix,
and encrypts what it carries: a process without the run's credentials cannot
register a slot, read the pseudo-gradients or the state a joiner receives, or
write a record. Keys are written readable by their owner only (0600).

Without mutual TLS (a jax older than 0.11.2, or no credentials given), the
service and the machines refuse any address but loopback unless told that the
network is private (`private_network=True`; `--private_network`,
`--elastic_private_network`): see `require_private`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import pathlib
import secrets
import socket

CA = "ca.pem"
CA_KEY = "ca-key.pem"
RUN = "run.json"


@dataclasses.dataclass(frozen=True)
class Credentials:
    """One party's files for jax's mutual TLS, and the run's peer prefix.

    Attributes:
      cert_file: its certificate (PEM).
      key_file: its private key (PEM).
      ca_file: the run's CA certificate (PEM).
      peer_prefix: the URI SAN prefix every peer's certificate must carry.
      token_sha256: SHA-256 of the run's token, if `make` was given it: a machine
        with another token stops before it registers (`check_token`).
    """

    cert_file: str
    key_file: str
    ca_file: str
    peer_prefix: str
    token_sha256: str | None = None

    def jax_kwargs(self) -> dict[str, str]:
        """The `mtls_*` keyword arguments of jaxlib's service and client."""
        return {
            "mtls_cert_file": self.cert_file,
            "mtls_key_file": self.key_file,
            "mtls_ca_file": self.ca_file,
            "mtls_peer_uri_prefix": self.peer_prefix,
        }


def _name(role: str | int) -> str:
    return "service" if role == "service" else f"machine-{int(role)}"


def make(directory: str, machines: int, *, days: int = 365, token: bytes | None = None) -> str:
    """Writes a new run's CA and certificates into `directory`; returns its peer prefix.

    `token`: the run's token, whose SHA-256 goes into run.json, so that a machine
    started with another token stops in one line before it registers a slot (a
    live machine's slot, claimed again, would be ended by jaxlib). Refuses
    (ValueError) a directory that already holds a run's CA: a second CA would
    lock out the machines that hold the first one's certificates.
    """
    from cryptography import x509  # noqa: PLC0415 - an optional dependency, on demand
    from cryptography.hazmat.primitives import hashes  # noqa: PLC0415
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import ExtendedKeyUsageOID  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    if not (isinstance(machines, int) and machines >= 1):
        raise ValueError(f"machines={machines!r} must be an integer >= 1.")
    if not (isinstance(days, int) and days >= 1):
        raise ValueError(f"days={days!r} must be an integer >= 1.")
    out = pathlib.Path(directory)
    if (out / CA).exists():
        raise ValueError(f"{out / CA} exists: this directory holds a run's credentials already.")
    out.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(8)
    prefix = f"lpdec://run-{run_id}/"
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))

    def write_key(path: pathlib.Path, key) -> None:
        data = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name(f"lpdec run {run_id} CA"))
        .issuer_name(name(f"lpdec run {run_id} CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (out / CA).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_key(out / CA_KEY, ca_key)
    for role in ["service", *range(machines)]:
        key = ec.generate_private_key(ec.SECP256R1())
        uri = prefix + ("service" if role == "service" else f"machine/{role}")
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(f"lpdec run {run_id} {_name(role)}"))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid[0])
            .not_valid_after(valid[1])
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        (out / f"{_name(role)}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(out / f"{_name(role)}-key.pem", key)
    run = {"run_id": run_id, "peer_prefix": prefix, "machines": machines}
    if token is not None:
        run["token_sha256"] = hashlib.sha256(bytes(token)).hexdigest()
    (out / RUN).write_text(json.dumps(run) + "\n")
    return prefix


def load(directory: str, role: str | int) -> Credentials:
    """The credentials of `role` ("service" or a machine slot) in `directory` (`make`'s).

    Raises a one-line ValueError naming a missing file or a slot the run lacks.
    """
    root = pathlib.Path(directory)

    def need(path: pathlib.Path) -> pathlib.Path:
        if not path.is_file():
            raise ValueError(
                f"credentials {directory!r}: {path.name} is missing (make them with "
                "`python -m lpdec.elastic credentials DIR --machines M`)"
            )
        return path

    try:
        run = json.loads(need(root / RUN).read_text())
        prefix = str(run["peer_prefix"])
        machines = int(run["machines"])
    except (ValueError, KeyError, TypeError) as error:
        if "is missing" in str(error):
            raise
        raise ValueError(f"credentials {directory!r}: {RUN} is not readable: {error}") from None
    if role != "service" and not 0 <= int(role) < machines:
        raise ValueError(f"credentials {directory!r} are for {machines} machines, not slot {role}")
    cert, key = need(root / f"{_name(role)}.pem"), need(root / f"{_name(role)}-key.pem")
    token_sha256 = run.get("token_sha256")
    return Credentials(str(cert), str(key), str(need(root / CA)), prefix, token_sha256)


def check_token(credentials: Credentials, token: bytes) -> None:
    """One-line ValueError if `token` is not the one the credentials were made with."""
    if credentials.token_sha256 is not None and not hmac.compare_digest(
        hashlib.sha256(bytes(token)).hexdigest(), credentials.token_sha256
    ):
        raise ValueError(
            "this machine's token is not the run's (its credentials were made with "
            "another): it stops before it registers, leaving the run's machines alone"
        )


def is_loopback(address: str) -> bool:
    """Whether host:port's host is a loopback address (or a name that resolves to one)."""
    host = str(address).rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(resolved) and all(ipaddress.ip_address(a).is_loopback for a in resolved)


def require_private(address: str, credentials: Credentials | None, private_network: bool) -> None:
    """One-line ValueError for an unauthenticated service or client off loopback.

    Without credentials, anyone who reaches `address` can register a slot and read
    every payload: allowed on loopback, or where the user says the network is private.
    """
    if credentials is None and not private_network and not is_loopback(address):
        raise ValueError(
            f"{address} is not a loopback address and the run has no credentials: anyone who "
            "reaches it could join the run and read every payload. Make credentials "
            "(python -m lpdec.elastic credentials DIR) and pass them, or say the network is "
            "private (--private_network / --elastic_private_network)."
        )


def mutual_tls_unavailable() -> str | None:
    """Why this jaxlib's coordination service cannot take credentials (one line), or None."""
    from lpdec.elastic import _runtime  # noqa: PLC0415

    try:
        _runtime.require_mtls()
    except ValueError as error:
        return str(error)
    return None


def check(address: str, credentials: Credentials | None, private_network: bool) -> None:
    """`require_private`, and with credentials a jaxlib that takes them: one-line ValueError."""
    require_private(address, credentials, private_network)
    if credentials is not None:
        from lpdec.elastic import _runtime  # noqa: PLC0415

        _runtime.require_mtls()
