"""Signed records: what the job's members write is believed only with the job's secret.

Anyone who reaches a job's store port can write any key, so every record the coordinator
or a worker acts on (see keys.py) carries an HMAC-SHA256 under the per-job secret
(`GPUFLEX_JOB_SECRET`, given to the coordinator and the workers in their environment):

    gf1.<64 hex digits of the MAC>.<value>

The MAC covers the store key next to the value, so a valid record cannot be replayed under
another key (a verdict of generation 3 as one of generation 4, worker 1's `done` as worker
2's), and `Signer` adds the run (a random id the coordinator draws at start and publishes
signed under `run`), so a record of an earlier store of the same job cannot be replayed
into this one. A record that fails verification raises `Forged`; the reader ignores it.

Without a secret on both sides a job runs unauthenticated (standalone runs, jobs created
before secrets): values are then written as they are. A reader that has a secret never
accepts an unsigned value. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any, Callable

PREFIX = "gf1."
_MAC_HEX = 64

log = logging.getLogger(__name__)


class Forged(ValueError):
    """A record whose MAC does not verify (a wrong secret, another key, a changed value,
    or no MAC at all where one is required)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


def _mac(secret: str, key: str, value: str) -> str:
    # The key and the value joined by a byte that neither contains in text form, so
    # ("a", "b.c") and ("a.b", "c") never share a MAC.
    msg = key.encode() + b"\x00" + value.encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def sign(secret: str, key: str, value: str) -> str:
    """`value` as a record for store key `key`, signed with `secret`."""
    return f"{PREFIX}{_mac(secret, key, value)}.{value}"


def verify(secret: str, key: str, text: str | bytes) -> str:
    """The value of a record `sign(secret, key, value)` made; Forged for anything else."""
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError:
            raise Forged(key, "not text") from None
    if not text.startswith(PREFIX) or len(text) < len(PREFIX) + _MAC_HEX + 1 \
            or text[len(PREFIX) + _MAC_HEX] != ".":
        raise Forged(key, "not signed")
    mac, value = text[len(PREFIX):len(PREFIX) + _MAC_HEX], text[len(PREFIX) + _MAC_HEX + 1:]
    if not hmac.compare_digest(mac, _mac(secret, key, value)):
        raise Forged(key, "bad signature")
    return value


class Signer:
    """Signs and verifies the records of one run of a job's store. `secret` None: the
    unauthenticated mode (values pass through as they are). `run` is the run id that every
    MAC is bound to besides the key (empty for the `run` record itself)."""

    def __init__(self, secret: str | None, run: str = "") -> None:
        self.secret = secret or None
        self.run = run

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def for_run(self, run: str) -> "Signer":
        return Signer(self.secret, run)

    def _domain(self, key: str) -> str:
        return f"{self.run}/{key}" if self.run else key

    def sign(self, key: str, value: str) -> str:
        return sign(self.secret, self._domain(key), value) if self.secret else value

    def verify(self, key: str, text: str | bytes) -> str:
        """The value of `text` read from `key`; Forged when it does not verify."""
        if not self.secret:
            if isinstance(text, bytes):
                try:
                    return text.decode()
                except UnicodeDecodeError:
                    raise Forged(key, "not text") from None
            return text
        try:
            return verify(self.secret, self._domain(key), text)
        except Forged as e:
            raise Forged(key, e.reason) from None


class ForgeryLog:
    """Records that failed verification: counted once per (key, text) and logged, so a
    forged key read on every poll is reported once. `summary()` is the coordinator's
    status field `forged`."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.count = 0
        self.last: str | None = None
        self._seen: set[tuple[str, bytes]] = set()

    def note(self, key: str, text: str | bytes, reason: str) -> None:
        raw = text.encode() if isinstance(text, str) else bytes(text)
        if (key, raw[:256]) in self._seen:
            return
        if len(self._seen) < 10_000:
            self._seen.add((key, raw[:256]))
        self.count += 1
        self.last = key
        log.warning("%s: ignored a forged record at %s (%s)", self.who, key, reason)

    def summary(self) -> dict[str, object]:
        return {"count": self.count, "last": self.last}


class SignedRecords:
    """Reads a store's signed records: `has(key)` and `get(key)` reach the store; what does
    not verify is noted in `forged` and read as absent."""

    def __init__(self, has: Callable[[str], bool], get: Callable[[str], bytes], signer: Signer,
                 forged: ForgeryLog) -> None:
        self.has, self.get, self.signer, self.forged = has, get, signer, forged

    def read(self, key: str) -> str | None:
        """The value of a signed record; None when absent or forged."""
        if not self.has(key):
            return None
        text = self.get(key)
        try:
            return self.signer.verify(key, text)
        except Forged as e:
            self.forged.note(key, text, e.reason)
            return None

    def valid(self, key: str) -> bool:
        return self.read(key) is not None

    def json(self, key: str) -> Any:
        """A signed JSON record's value; None when absent, forged or not JSON."""
        value = self.read(key)
        if value is None:
            return None
        try:
            return json.loads(value)
        except ValueError:
            self.forged.note(key, value, "not JSON")
            return None


class KeptRecords:
    """The records only the coordinator writes (the run, the newest generation, an abort),
    kept as it wrote them: `enforce` puts back one changed by anyone else, deletes one of
    `unwritten` that someone wrote (a generation published ahead of it, an abort), and
    counts each in `forged`. `store`: the job's store (its check/get/set/delete_key)."""

    def __init__(self, store: Any, forged: ForgeryLog) -> None:
        self.store, self.forged = store, forged
        self.texts: dict[str, str] = {}

    def put(self, key: str, text: str) -> None:
        self.texts[key] = text
        self.store.set(key, text)

    def forget(self, key: str) -> None:   # written once, no longer kept
        self.texts.pop(key, None)

    def enforce(self, unwritten: list[str]) -> None:
        for key, text in self.texts.items():
            have = self.store.get(key) if self.store.check([key]) else None
            if have is None or have.decode(errors="replace") != text:
                if have is not None:
                    self.forged.note(key, have, "overwritten")
                self.store.set(key, text)
        for key in unwritten:
            if key not in self.texts and self.store.check([key]):
                self.forged.note(key, self.store.get(key), "not written by the coordinator")
                self.store.delete_key(key)
