"""The one place that reaches into jaxlib for its coordination service and client.

`jax.distributed.initialize` builds the same two objects, but only as one gang
of processes (a service inside process 0, every process registered before any
starts). The elastic run needs them apart: a service in its own process and a
client per machine that may die and register again. jaxlib exposes both as
`_jax.get_distributed_runtime_service` / `get_distributed_runtime_client`,
unchanged from jax 0.10 to 0.12 (the versions lpdec supports); a jax whose
jaxlib lacks them fails here, in one line, not in the middle of a run.
"""

from __future__ import annotations

from typing import Any

_NEEDED = ("get_distributed_runtime_service", "get_distributed_runtime_client")


def jax_runtime() -> Any:
    """jaxlib's `_jax` module, checked for the service and the client."""
    try:
        from jax._src.lib import _jax  # noqa: PLC0415 (jaxlib's private module, on demand)
    except ImportError as error:  # pragma: no cover - every supported jax has it
        raise RuntimeError(f"this jaxlib has no coordination service to use: {error}") from error
    missing = [name for name in _NEEDED if not hasattr(_jax, name)]
    if missing:  # pragma: no cover
        raise RuntimeError(
            f"this jaxlib lacks {', '.join(missing)}; lpdec.elastic needs jax 0.10 to 0.12."
        )
    return _jax


def check_address(address: str, what: str) -> None:
    """One line for an address that is not host:port."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}={address!r} must be host:port (e.g. 127.0.0.1:29600).")


def mtls_supported() -> bool:
    """Whether jaxlib's service and client take mutual TLS (`mtls_*`; jax >= 0.11.2)."""
    runtime = jax_runtime()
    return all("mtls_cert_file" in (getattr(runtime, name).__doc__ or "") for name in _NEEDED)


def require_mtls() -> None:
    """One line if this jaxlib cannot use credentials."""
    if not mtls_supported():
        import jax  # noqa: PLC0415

        raise ValueError(
            f"credentials need mutual TLS in jax's coordination service (jax >= 0.11.2); this "
            f"is jax {jax.__version__}. Upgrade jax, or run without credentials on loopback or "
            "a private network (--private_network)."
        )
