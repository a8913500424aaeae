"""The run's token: HMAC-SHA256 signatures over the protocol's records.

Every contribution header, round decision, join request and state an elastic
run writes is signed under the run's token (never written anywhere); what does
not verify is ignored, so a process without the token cannot add to a mean,
decide a round or receive the model.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any


def digest(data: bytes) -> str:
    """SHA-256 of `data`, hex."""
    return hashlib.sha256(data).hexdigest()


class Signer:
    """Signs and checks records under `token`; b"" signs nothing that verifies."""

    def __init__(self, token: bytes):
        self._token = bytes(token)

    def sign(self, *fields: Any) -> str:
        """The MAC of `fields`, joined by "|" as text."""
        message = "|".join(str(f) for f in fields).encode()
        return hmac.new(self._token, message, hashlib.sha256).hexdigest()

    def verify(self, mac: Any, *fields: Any) -> bool:
        """Whether `mac` is `sign(*fields)` (never, without a token)."""
        return bool(self._token) and hmac.compare_digest(str(mac), self.sign(*fields))
