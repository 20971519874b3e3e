"""The batched llama engine's per-slot parts that need no model: slot choice for
prompt prefix reuse, and token bytes to text (split characters, stop strings)."""

from __future__ import annotations

import pytest

from node.llama.slots import MIN_REUSE, Slot, SlotJob, TextOut, common_prefix, pick_slot


def test_common_prefix_counts_the_shared_head() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([7, 8], [7, 8]) == 2


def busy(seq: int) -> Slot:
    slot = Slot(seq, cached=[1, 2, 3, 4])
    slot.job = SlotJob(1, [1], 1, None, print, TextOut(), None)  # type: ignore[arg-type]
    return slot


SYSTEM = list(range(100, 100 + MIN_REUSE))  # a prefix worth reusing


def test_the_free_slot_with_the_longest_shared_prefix_wins() -> None:
    slots = [Slot(0, [*SYSTEM, 9], used=1), Slot(1, [*SYSTEM, 2, 3, 8], used=2), busy(2)]
    busy_slot = slots[2]
    busy_slot.cached = [*SYSTEM, 2, 3, 4]
    slot, keep = pick_slot(slots, [*SYSTEM, 2, 3, 4, 5])
    assert slot.seq == 1 and keep == MIN_REUSE + 2  # the busy slot shares more but is taken


def test_a_short_shared_prefix_takes_the_least_recently_used_slot() -> None:
    # Sharing BOS and a word is not worth evicting the slot that holds a system prompt.
    slots = [Slot(0, [1, *SYSTEM], used=5), Slot(1, [7, 7], used=3), Slot(2, [], used=0)]
    slot, keep = pick_slot(slots, [1, 2, 3])
    assert slot.seq == 2 and keep == 0  # never used first
    slots[2].used = 9
    slot, keep = pick_slot(slots, [1, 2, 3])
    assert slot.seq == 1 and keep == 0


def test_a_short_prompt_asked_again_reuses_its_slot() -> None:
    slots = [Slot(0, [1, 2, 3, 9], used=5), Slot(1, [], used=0)]
    slot, keep = pick_slot(slots, [1, 2, 3])
    assert slot.seq == 0 and keep == 2


def test_a_prompt_cached_whole_still_evaluates_its_last_token() -> None:
    _, keep = pick_slot([Slot(0, [*SYSTEM, 4, 5])], [*SYSTEM, 4])
    assert keep == MIN_REUSE  # the sampler needs the last prompt token's logits


def test_without_reuse_the_slot_sharing_least_is_emptied() -> None:
    # cache_prompt: false: the whole prompt from position 0, in the slot whose cache
    # is least worth keeping for this prompt's neighbours.
    slots = [Slot(0, [*SYSTEM, 2], used=1), Slot(1, [5, 6], used=4), Slot(2, [5], used=2)]
    slot, keep = pick_slot(slots, [*SYSTEM, 2, 3], reuse=False)
    assert slot.seq == 2 and keep == 0  # shares nothing, used before slot 1
    slot, keep = pick_slot(slots[:1], [*SYSTEM, 2, 3], reuse=False)
    assert slot.seq == 0 and keep == 0  # even the only slot keeps nothing


def test_no_free_slot_is_an_error() -> None:
    with pytest.raises(ValueError, match="no free slot"):
        pick_slot([busy(0)], [1])


def test_a_character_split_over_tokens_comes_out_whole() -> None:
    out = TextOut()
    check = "✓".encode()
    assert out.feed(check[:1]) == ("", False)
    assert out.feed(check[1:2]) == ("", False)
    assert out.feed(check[2:] + b"!") == ("✓!", False)
    assert out.text == "✓!"


def test_text_that_may_start_a_stop_string_is_held_until_it_cannot() -> None:
    out = TextOut(stops=["\nQ:"])
    assert out.feed(b"Paris") == ("Paris", False)
    assert out.feed(b"\n") == ("", False)  # maybe the next turn
    assert out.feed(b"Q") == ("", False)
    assert out.feed(b"uiet") == ("\nQuiet", False)  # it was not
    assert out.feed(b".\nQ: next") == (".", True)
    assert out.text == "Paris\nQuiet."


def test_the_held_text_and_a_half_character_come_out_at_a_length_end() -> None:
    out = TextOut(stops=["END"])
    assert out.feed(b"and E") == ("and ", False)
    assert out.feed("é".encode()[:1]) == ("", False)
    assert out.flush() == "E\ufffd"  # a half character is replaced, not lost silently
    assert out.text == "and E\ufffd"


def test_the_first_stop_string_found_ends_the_text() -> None:
    out = TextOut(stops=["B", "A"])
    assert out.feed(b"xxAyyB") == ("xx", True)


def test_a_plain_chat_answer_loses_its_leading_whitespace() -> None:
    out = TextOut(lstrip=True)
    assert out.feed(b" ") == ("", False)
    assert out.feed(b" Paris") == ("Paris", False)
    assert out.feed(b" is") == (" is", False)
