"""An elastic run's credentials (issue 43, item 1): nothing without them reaches the run.

The certificates against the `cryptography` library's own verification; the
refusals off loopback in one line; and, on a jax whose coordination service
takes mutual TLS (>= 0.11.2: CI's newest), a service with the run's credentials
that two of its machines join while processes without credentials, or with
another run's, are refused at its gate with their reason and change nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
import stat
import subprocess
import sys
import threading
import time

import pytest

from bench import harness
from lpdec import elastic
from lpdec.elastic import _runtime
from lpdec.elastic import credentials

ROOT = pathlib.Path(__file__).resolve().parent.parent
x509 = pytest.importorskip("cryptography.x509")


def _verify(cert, issuer) -> None:
    """Raises unless `issuer`'s key signed `cert` (ECDSA-SHA256, as `make` signs)."""
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415

    issuer.public_key().verify(
        cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm)
    )


def test_each_certificate_is_signed_by_the_runs_ca_and_names_its_slot(tmp_path):
    prefix = credentials.make(str(tmp_path / "run"), 3, days=2)
    assert prefix.startswith("lpdec://run-") and prefix.endswith("/")
    ca = x509.load_pem_x509_certificate((tmp_path / "run" / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    _verify(ca, ca)
    other = x509.load_pem_x509_certificate(
        (pathlib.Path(credentials_dir(tmp_path)) / "ca.pem").read_bytes()
    )
    for role, uri in [("service", "service"), (0, "machine/0"), (2, "machine/2")]:
        creds = credentials.load(str(tmp_path / "run"), role)
        cert = x509.load_pem_x509_certificate(pathlib.Path(creds.cert_file).read_bytes())
        _verify(cert, ca)
        with pytest.raises(Exception):  # noqa: B017 - cryptography's InvalidSignature
            _verify(cert, other)  # another run's CA did not sign it
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [prefix + uri]
        assert creds.peer_prefix == prefix and creds.ca_file.endswith("ca.pem")
        assert stat.S_IMODE(pathlib.Path(creds.key_file).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "run" / "ca-key.pem").stat().st_mode) == 0o600
    # One-line refusals: a second CA over the first, a slot the run lacks, a missing file.
    for call, message in [
        (lambda: credentials.make(str(tmp_path / "run"), 3), "holds a run's credentials"),
        (lambda: credentials.load(str(tmp_path / "run"), 3), "for 3 machines, not slot 3"),
        (lambda: credentials.load(str(tmp_path / "none"), 0), "run.json is missing"),
    ]:
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


def credentials_dir(tmp_path) -> str:
    """Another run's credentials, made once per test directory."""
    path = tmp_path / "other"
    if not path.exists():
        credentials.make(str(path), 3)
    return str(path)


def test_off_loopback_without_credentials_is_refused_unless_the_network_is_private(tmp_path):
    from configs import elastic_mlp  # noqa: PLC0415
    from train_lib import elastic as elastic_lib  # noqa: PLC0415
    from train_lib.errors import ConfigError  # noqa: PLC0415

    message = "is not a loopback address and the run has no credentials"
    with pytest.raises(ValueError, match=message):
        elastic.start("10.11.12.13:29600", 3, token=b"t")
    with pytest.raises(ValueError, match=message):
        elastic.ElasticGroup("10.11.12.13:29600", 0, 3, b"t", "fp")
    options = elastic_lib.ElasticOptions(
        service="10.11.12.13:29600", machine=0, machines=3, token=b"t"
    )
    with pytest.raises(ConfigError, match=message):
        elastic_lib.check(elastic_mlp.get_config(), options)
    # Loopback, or the user's word: nothing is refused before connecting.
    elastic.ElasticGroup("127.0.0.1:29600", 0, 3, b"t", "fp")
    elastic.ElasticGroup("10.11.12.13:29600", 0, 3, b"t", "fp", private_network=True)
    elastic_lib.check(elastic_mlp.get_config(), dataclasses.replace(options, private_network=True))
    # The machine's credentials are read before anything starts: a directory without
    # them fails, and so does a token other than the one they were made with.
    credentials.make(str(tmp_path / "run"), 3, token=b"the run's token")
    lacking = dataclasses.replace(options, machine=2, credentials=str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="run.json is missing"):
        elastic_lib.check(elastic_mlp.get_config(), lacking)
    if _runtime.mtls_supported():
        mine = dataclasses.replace(options, machine=2, credentials=str(tmp_path / "run"))
        right = dataclasses.replace(mine, token=b"the run's token")
        elastic_lib.check(elastic_mlp.get_config(), right)
        with pytest.raises(ConfigError, match="token is not the run's"):
            elastic_lib.check(elastic_mlp.get_config(), mine)  # token b"t"
    creds = credentials.load(str(tmp_path / "run"), 1)
    credentials.check_token(creds, b"the run's token")
    with pytest.raises(ValueError, match="token is not the run's"):
        credentials.check_token(creds, b"another")


def test_credentials_on_a_jax_without_mutual_tls_are_refused_in_one_line(tmp_path, monkeypatch):
    credentials.make(str(tmp_path / "run"), 2)
    service = credentials.load(str(tmp_path / "run"), "service")
    monkeypatch.setattr(_runtime, "mtls_supported", lambda: False)
    with pytest.raises(ValueError, match=r"need mutual TLS .* \(jax >= 0.11.2\)"):
        elastic.start("127.0.0.1:29600", 2, token=b"t", credentials=service)
    with pytest.raises(ValueError, match=r"need mutual TLS"):
        elastic.ElasticGroup(
            "127.0.0.1:29600",
            0,
            2,
            b"t",
            "fp",
            credentials=credentials.load(str(tmp_path / "run"), 0),
        )


STRANGER = """
import sys
sys.path.insert(0, sys.argv[1])
from lpdec import elastic
from lpdec.elastic import credentials
creds = credentials.load(sys.argv[3], 1) if sys.argv[3] else None
group = elastic.ElasticGroup(sys.argv[2], 1, 2, sys.argv[4].encode(), "fp", connect_timeout=3,
                             heartbeat_timeout=3, credentials=creds)
try:
    group.connect()
except elastic.GateRefused as error:
    print("REFUSED:", error, flush=True)
    sys.exit(2)
print("REGISTERED", flush=True)
"""


@pytest.mark.skipif(not _runtime.mtls_supported(), reason="this jax has no mutual TLS")
def test_processes_without_the_runs_credentials_cannot_register_and_change_nothing(tmp_path):
    """With mutual TLS, on live slot 1: no certificates and no token; another run's
    certificates with that run's token; no certificates with the run's token. Each is
    refused at the gate, before it registers, with its own reason."""
    run, other = str(tmp_path / "run"), credentials_dir(tmp_path)
    credentials.make(run, 2)
    address = f"127.0.0.1:{harness.free_port_pair()}"  # the gate's port and jax's, + 1
    service = elastic.start(
        address, 2, token=b"token", heartbeat_timeout=3,
        credentials=credentials.load(run, "service"),
    )  # fmt: skip
    groups: dict[int, elastic.ElasticGroup] = {}

    def connect(m: int) -> None:
        group = elastic.ElasticGroup(
            address, m, 2, b"token", "fp", heartbeat_timeout=3, connect_timeout=30,
            credentials=credentials.load(run, m),
        )  # fmt: skip
        group.connect()
        groups[m] = group

    threads = [threading.Thread(target=connect, args=(m,)) for m in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert sorted(groups) == [0, 1], "the run's own machines could not register"
        live = groups[0].live()
        strangers = [
            ("", "", "refused machine 1: wrong or missing token"),
            (other, "another run's token", "refused machine 1: wrong or missing token"),
            ("", "token", "takes only the run's credentials (mutual TLS)"),
        ]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            ended = list(
                pool.map(
                    lambda s: subprocess.run(
                        [sys.executable, "-c", STRANGER, str(ROOT), address, s[0], s[1]],
                        capture_output=True,
                        text=True,
                        timeout=90,
                    ),  # fmt: skip
                    strangers,
                )
            )
        for proc, (_, _, reason) in zip(ended, strangers, strict=True):
            assert proc.returncode == 2 and "REFUSED:" in proc.stdout, proc.stdout + proc.stderr
            assert reason in proc.stdout, proc.stdout
        time.sleep(4)  # past a heartbeat timeout: the service would have noticed by now
        # The run's machines kept their slots and incarnations, and the store serves them.
        assert groups[0].live() == live and not groups[0].lost() and not groups[1].lost()
        assert groups[0].store.put("after", b"1") and groups[1].store.get("after") == b"1"
    finally:
        for group in groups.values():
            group.close()
        service.shutdown()
