"""hostops.read_file in chunks: a multi-byte UTF-8 character is never split between reads."""

from __future__ import annotations

import pytest

from gpuflex.hosts.hostops import read_file

TEXT = "step 1 é loss €0.5\n𝄞 naïve — 日本語 ok\n" * 3


def read_chunks(path, limit: int) -> list[dict]:
    """Every read of `path` from 0 until one returns no text, as `gpuflex logs` does."""
    replies, offset = [], 0
    for _ in range(10_000):
        reply = read_file(str(path), offset, limit)
        if not reply["data"]:
            return replies
        assert reply["offset"] > offset
        replies.append(reply)
        offset = reply["offset"]
    raise AssertionError("read_file never reached the end")


@pytest.mark.parametrize("limit", range(4, 12))
def test_chunks_join_to_the_original_text(tmp_path, limit):
    path = tmp_path / "worker.log"
    path.write_bytes(TEXT.encode())
    replies = read_chunks(path, limit)
    assert "".join(r["data"] for r in replies) == TEXT
    assert all("\ufffd" not in r["data"] for r in replies)
    assert replies[-1]["offset"] == len(TEXT.encode())
    assert all(len(r["data"].encode()) <= limit for r in replies)


def test_a_chunk_ending_inside_a_character_stops_before_it(tmp_path):
    path = tmp_path / "worker.log"
    path.write_bytes("ab€cd".encode())  # € is 3 bytes: offsets 2..4
    first = read_file(str(path), 0, 4)
    assert (first["data"], first["offset"]) == ("ab", 2)
    second = read_file(str(path), first["offset"], 4)
    assert (second["data"], second["offset"]) == ("€c", 6)


@pytest.mark.parametrize("content,limit,text", [
    ("é".encode() * 2, 1, "\ufffd" * 4),           # a limit smaller than one character
    (b"ab\xe2\x82", 1 << 20, "ab\ufffd"),          # the file ends inside a character
    (b"a\xff\xfeb" * 3, 2, "a\ufffd\ufffdb" * 3),  # bytes that are not UTF-8
], ids=["limit-below-a-character", "truncated-at-the-end", "invalid-bytes"])
def test_uncuttable_chunks_are_replaced_and_reading_still_ends(tmp_path, content, limit, text):
    path = tmp_path / "worker.log"
    path.write_bytes(content)
    replies = read_chunks(path, limit)
    assert "".join(r["data"] for r in replies) == text
    assert replies[-1]["offset"] == len(content)
