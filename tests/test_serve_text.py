"""The server's text stream: incremental decoding of multi-byte characters, and stop strings."""

from __future__ import annotations

import pytest

from cbcore.serve.text import TextStream
from cbcore.testing.tiny_tokenizer import tiny_tokenizer

TEXT = "café crème 東京 北京市の中文 😀 señor Ωmega 🎉 Zürich"  # some characters not in the training text


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_one_token_at_a_time_never_emits_half_a_character(tok):
    ids = tok.encode(TEXT)
    # Some characters span several byte-level tokens: a prefix of the ids can end mid-character.
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids)))
    stream = TextStream(tok)
    pieces = [stream.push([t], "length" if i == len(ids) - 1 else None).text for i, t in enumerate(ids)]
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert stream.num_tokens == len(ids)


@pytest.mark.parametrize("stop", ["東京", "crème 東", "北京", "😀", "ñ", "ich", "é c"])
def test_stop_strings_end_the_text_before_them_wherever_tokens_split(tok, stop):
    ids = tok.encode(TEXT)
    stream = TextStream(tok, [stop, "not in the text"])
    out, finish, used = "", None, 0
    for t in ids:
        delta = stream.push([t], None)
        out += delta.text
        used += 1
        assert stop not in out
        if delta.finish_reason:
            finish = delta.finish_reason
            break
    assert (out, finish) == (TEXT[: TEXT.index(stop)], "stop")
    # The token that completed the match is the last one counted.
    assert stop in tok.decode(ids[:used]) and stop not in tok.decode(ids[: used - 1])
    assert stream.num_tokens == used and stream.finished


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop(tok):
    ids = tok.encode("the cat sat")
    stream = TextStream(tok, ["cats"])
    text = "".join(stream.push([t], "stop" if i == len(ids) - 1 else None).text for i, t in enumerate(ids))
    assert text == "the cat sat"


def test_a_length_cut_inside_a_character_drops_it_instead_of_emitting_u_fffd(tok):
    ids = tok.encode("ok 😀")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    stream = TextStream(tok)
    pieces = [stream.push([t], "length" if i == cut - 1 else None) for i, t in enumerate(ids[:cut])]
    assert "".join(p.text for p in pieces) == tok.decode(ids[:cut]).rstrip("\ufffd")
    assert pieces[-1].finish_reason == "length" and stream.num_tokens == cut


def _first_stop_cut(text: str, stops: list[str]) -> int | None:
    """Where the text ends under OpenAI's rule, read one character at a time: before the first stop to end."""
    for end in range(1, len(text) + 1):
        hits = [len(s) for s in stops if text[:end].endswith(s)]
        if hits:
            return end - max(hits)
    return None


class _Chars:
    """A tokenizer whose tokens are characters (ids are code points), to drive TextStream exactly."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def test_stop_matching_agrees_with_a_plain_search_however_the_text_is_split():
    import random

    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        stream = TextStream(_Chars(), stops)
        ids, out, finish, i = [ord(c) for c in text], "", None, 0
        while i < len(ids) and finish is None:
            n = rng.randint(1, 4)
            delta = stream.push(ids[i : i + n], "length" if i + n >= len(ids) else None)
            out, finish, i = out + delta.text, delta.finish_reason, i + n
            assert not any(s in out for s in stops), (text, stops, out)
        cut = _first_stop_cut(text, stops)
        assert (out, finish) == ((text, "length") if cut is None else (text[:cut], "stop")), (text, stops)


class _Counting(tuple):
    reads = 0

    def __getitem__(self, i):  # type: ignore[override]
        _Counting.reads += 1
        return tuple.__getitem__(self, i)


def test_stop_matching_costs_per_character_not_per_stop_string():
    """Each character costs a bounded number of automaton moves, with ten thousand stop strings as with one."""
    import dataclasses
    import random

    from cbcore.serve import stops as stops_module

    rng = random.Random(1)
    text = "".join(rng.choice("abcd") for _ in range(5000))
    for count in (1, 10_000):
        stops = ["".join(rng.choice("abcd") for _ in range(12)) + "e" for _ in range(count)]  # never matched
        matcher = stops_module.StopMatcher(tuple(stops))
        matcher.automaton = dataclasses.replace(matcher.automaton, fail=_Counting(matcher.automaton.fail))
        _Counting.reads = 0
        for k in range(0, len(text), 3):
            assert matcher.feed(text[k : k + 3]) is None
        # Aho-Corasick's bound: the fail links followed never exceed the characters read.
        assert _Counting.reads <= len(text), (count, _Counting.reads)
