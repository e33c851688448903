"""An in-memory job store and a hand-driven clock, for testing the coordinator's
generation logic (gpuflex.elastic.coordinator.generations) without processes."""

from __future__ import annotations


class FakeStore:
    """The TCPStore methods the generation logic uses, over a dict (values kept as bytes).
    `looked_at` lists the keys checked or read, in order (a test may clear it)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.looked_at: list[str] = []

    def check(self, keys: list[str]) -> bool:
        self.looked_at.extend(keys)
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        self.looked_at.append(key)
        return self.data[key]   # a real store would block until the key appears

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


class Clock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
