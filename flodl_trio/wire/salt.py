"""The session salt and the truncated HMAC every authenticated message carries.

The salt is both the session identity and the MAC key (flodl does no key
derivation). ``MAC8(x)`` is the first 8 bytes of HMAC-SHA256(salt, x).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from typing import Any

import attrs

from ..errors import ConfigError, MacError
from .constants import MAC_LEN, SALT_LEN

Buffer = bytes | bytearray | memoryview


_LOWER_HEX = frozenset("0123456789abcdef")


@attrs.frozen(repr=False)
class SessionSalt:
    """16 random bytes shared by every process of one training session."""

    raw: bytes = attrs.field()
    # A keyed HMAC to copy(): keying costs two compressions, copy() costs none.
    _keyed: hmac.HMAC = attrs.field(init=False, eq=False, hash=False)

    @raw.validator
    def _check_len(self, _attr: object, value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != SALT_LEN:
            got = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
            raise ConfigError(f"session salt must be {SALT_LEN} raw bytes, got {got}")

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_keyed", hmac.new(self.raw, digestmod=hashlib.sha256))

    @classmethod
    def generate(cls) -> SessionSalt:
        """A fresh random salt for a new session."""
        return cls(secrets.token_bytes(SALT_LEN))

    @classmethod
    def from_hex(cls, text: str) -> SessionSalt:
        """Parse the 32-lowercase-hex-character form used on command lines and files
        (surrounding whitespace, such as a file's last newline, is ignored)."""
        stripped = text.strip()
        if len(stripped) != 2 * SALT_LEN:
            raise ConfigError(
                f"session salt hex must be exactly {2 * SALT_LEN} characters, got {len(stripped)}"
            )
        if not set(stripped) <= _LOWER_HEX:  # (the error does not echo the secret)
            raise ConfigError("session salt hex must be lowercase hex (0-9, a-f): it holds uppercase or non-hex characters")
        return cls(bytes.fromhex(stripped))

    @classmethod
    def coerce(cls, value: SessionSalt | bytes | bytearray) -> SessionSalt:
        """Accept a SessionSalt or its 16 raw bytes (what every public API takes)."""
        if isinstance(value, SessionSalt):
            return value
        if isinstance(value, (bytes, bytearray)):
            return cls(bytes(value))
        raise ConfigError(f"salt must be a SessionSalt or 16 bytes, got {type(value).__name__}")

    def hex(self) -> str:
        return self.raw.hex()

    def hmac(self) -> Any:
        """A fresh incremental HMAC-SHA256 keyed with this salt."""
        return self._keyed.copy()

    def mac8(self, *parts: Buffer) -> bytes:
        """MAC8 over the concatenation of ``parts`` (no concatenation is made)."""
        return self.mac8_of(parts)

    def mac8_of(self, parts: Iterable[Buffer]) -> bytes:
        h = self._keyed.copy()
        for part in parts:
            h.update(part)
        return h.digest()[:MAC_LEN]

    def __repr__(self) -> str:
        # Never print the key itself: logs end up in bug reports.
        return "SessionSalt(<redacted>)"


def verify_mac(expected: bytes, got: Buffer, what: str) -> None:
    """Constant-time tag comparison; raises MacError naming ``what``."""
    if not hmac.compare_digest(expected, bytes(got)):
        raise MacError(
            f"{what}: MAC mismatch (wrong session salt, or bytes corrupted in transit)"
        )
