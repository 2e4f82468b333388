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
