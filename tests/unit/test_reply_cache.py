"""``broker.reply_cache.ReplyCache``: safe retry's kept finals, bounded by age,
count and bytes, on a fake clock."""

from __future__ import annotations

from typing import Any

from broker import protocol as p
from broker.client_request import ClientRequest
from broker.reply_cache import ENTRY_OVERHEAD_BYTES, ReplyCache, fingerprint

A = b"client-a"
B = b"client-b"


def req(rid: str | int, prompt: str = "hello", **fields: Any) -> ClientRequest:
    return ClientRequest(id=rid, op="generate", prompt=prompt, **fields)


def final(rid: str | int, text: str = "done") -> dict[str, Any]:
    return p.ok_reply(rid, text=text)


def cost(body: dict[str, Any]) -> int:
    return len(p.pack(body)) + ENTRY_OVERHEAD_BYTES


def test_a_kept_reply_is_found_until_its_ttl_runs_out() -> None:
    cache = ReplyCache(ttl_ms=1000, max_entries=8, max_bytes=1 << 20)
    cache.keep((A, "x"), req("x"), final("x"), now=10.0)
    kept = cache.find((A, "x"), now=10.999)
    assert kept is not None and kept.body == final("x")
    assert cache.find((B, "x"), now=10.999) is None  # per client: another connection's id
    assert cache.find((A, "x"), now=11.0) is None
    assert len(cache) == 0 and cache.bytes == 0


def test_the_fingerprint_ignores_id_retry_and_budget_but_not_what_is_asked() -> None:
    assert fingerprint(req("a")) == fingerprint(req("b", retry=True))
    assert fingerprint(req("a")) == fingerprint(req("a", timeout_ms=5, priority="critical"))
    assert fingerprint(req("a")) != fingerprint(req("a", prompt="other"))
    assert fingerprint(req("a")) != fingerprint(req("a", max_tokens=5))
    assert fingerprint(req("a", stream=True)) != fingerprint(req("a"))


def test_the_entry_bound_drops_the_oldest_first() -> None:
    cache = ReplyCache(ttl_ms=60_000, max_entries=3, max_bytes=1 << 20)
    for i in range(5):
        cache.keep((A, i), req(i), final(i), now=float(i))
    assert len(cache) == 3
    assert [cache.find((A, i), 5.0) is not None for i in range(5)] == [False, False] + [True] * 3
    assert cache.evicted == 2


def test_the_byte_bound_holds_whatever_the_replies_weigh() -> None:
    big = final("big", text="x" * 4000)
    cache = ReplyCache(ttl_ms=60_000, max_entries=1000, max_bytes=3 * cost(big))
    for i in range(10):
        cache.keep((A, i), req(i), final(i, text="x" * 4000), now=float(i))
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 3 and cache.evicted == 7
    assert cache.bytes == sum(cost(final(i, text="x" * 4000)) for i in (7, 8, 9))


def test_a_reply_larger_than_the_byte_bound_is_not_kept() -> None:
    cache = ReplyCache(ttl_ms=60_000, max_entries=10, max_bytes=1024)
    cache.keep((A, "small"), req("small"), final("small"), now=0.0)
    cache.keep((A, "huge"), req("huge"), final("huge", text="y" * 2000), now=0.0)
    assert cache.find((A, "huge"), 0.0) is None
    assert cache.find((A, "small"), 0.0) is not None  # not evicted for a reply it cannot keep
    assert cache.evicted == 1


def test_a_second_reply_for_the_same_key_replaces_the_first() -> None:
    cache = ReplyCache(ttl_ms=1000, max_entries=10, max_bytes=1 << 20)
    cache.keep((A, "x"), req("x"), final("x", "one"), now=0.0)
    cache.keep((A, "x"), req("x", prompt="two"), final("x", "two"), now=0.5)
    kept = cache.find((A, "x"), now=1.2)  # the first one's time is up, not the second's
    assert kept is not None and kept.body["text"] == "two"
    assert kept.fingerprint == fingerprint(req("x", prompt="two"))
    assert len(cache) == 1 and cache.bytes == cost(final("x", "two"))


def test_a_gone_client_leaves_nothing_behind() -> None:
    cache = ReplyCache(ttl_ms=60_000, max_entries=10, max_bytes=1 << 20)
    cache.keep((A, 1), req(1), final(1), now=0.0)
    cache.keep((B, 1), req(1), final(1), now=0.0)
    cache.keep((A, 2), req(2), final(2), now=0.0)
    cache.forget_client(A)
    assert len(cache) == 1 and cache.find((B, 1), 0.0) is not None
    assert cache.bytes == cost(final(1))


def test_a_zero_ttl_keeps_nothing() -> None:
    cache = ReplyCache(ttl_ms=0, max_entries=10, max_bytes=1 << 20)
    cache.keep((A, 1), req(1), final(1), now=0.0)
    assert len(cache) == 0 and cache.snapshot()["entries"] == 0
