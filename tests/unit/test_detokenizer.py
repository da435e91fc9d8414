"""Incremental detokenization: UTF-8 characters split across tokens, stop strings across tokens."""

from __future__ import annotations

import random

import pytest

from pdserve.server.detokenizer import IncrementalDetokenizer

TEXT = "Héllo, 世界! 😀🎉 naïve café — 你好 🇫🇷 done."


class ByteTokenizer:
    """Each token is an arbitrary byte string; decoding joins the bytes and decodes UTF-8 with
    replacement, like a byte-level BPE tokenizer. Ids in ``special`` are special tokens."""

    def __init__(self):
        self.pieces: list[bytes] = []
        self.special: set[int] = set()

    def add(self, piece: bytes, special: bool = False) -> int:
        self.pieces.append(piece)
        if special:
            self.special.add(len(self.pieces) - 1)
        return len(self.pieces) - 1

    def tokens_for(self, data: bytes, rng: random.Random, max_len: int = 4) -> list[int]:
        ids, i = [], 0
        while i < len(data):
            n = rng.randint(1, max_len)
            ids.append(self.add(data[i : i + n]))
            i += n
        return ids

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        keep = [i for i in ids if not (skip_special_tokens and i in self.special)]
        return b"".join(self.pieces[i] for i in keep).decode("utf-8", errors="replace")


def run(detok: IncrementalDetokenizer, ids: list[int], matched=None, chunk: int = 1) -> list[str]:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish(matched))
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("chunk", [1, 3])
def test_split_characters_are_held_back_until_complete(seed, chunk):
    tok = ByteTokenizer()
    ids = tok.tokens_for(TEXT.encode(), random.Random(seed))
    deltas = run(IncrementalDetokenizer(tok), ids, chunk=chunk)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas), deltas


def test_every_byte_its_own_token():
    tok = ByteTokenizer()
    ids = [tok.add(bytes([b])) for b in "😀".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["", "", "", "😀"]


def test_incomplete_character_at_finish_is_flushed_as_replacement():
    tok = ByteTokenizer()
    ids = [tok.add(b"ok "), tok.add("世".encode()[:2])]
    deltas = run(IncrementalDetokenizer(tok), ids)
    assert deltas == ["ok ", "", "\ufffd"]
    assert "".join(deltas) == tok.decode(ids)


def test_invalid_byte_in_the_middle_matches_full_decode():
    tok = ByteTokenizer()
    ids = [tok.add(b"a"), tok.add(b"\xff"), tok.add(b"b"), tok.add("é".encode())]
    deltas = run(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == "a\ufffdbé"


def test_special_tokens_skipped_or_kept():
    tok = ByteTokenizer()
    eos = tok.add(b"<|im_end|>", special=True)
    ids = [tok.add(b"hi"), eos]
    assert "".join(run(IncrementalDetokenizer(tok), ids, matched=eos)) == "hi"
    assert (
        "".join(run(IncrementalDetokenizer(tok, skip_special_tokens=False), ids, matched=eos))
        == "hi<|im_end|>"
    )


@pytest.mark.parametrize("seed", range(10))
def test_stop_string_across_tokens_is_never_emitted(seed):
    text = "The answer is 42. STOP here and STOP again"
    tok = ByteTokenizer()
    ids = tok.tokens_for(text.encode(), random.Random(seed), max_len=3)
    # the scheduler stops at the token that completes the first "STOP"; it may be sent already
    end = next(k for k in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:k]))
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = [detok.push([i]) for i in ids[:end]]
    assert "S" not in "".join(deltas)  # "S", "ST", "STO" could start the stop string: held back
    deltas.append(detok.finish("STOP"))
    assert "".join(deltas) == "The answer is 42. "


def test_stop_prefix_released_when_it_does_not_complete():
    tok = ByteTokenizer()
    ids = [tok.add(b"a ST"), tok.add(b"AR"), tok.add(b"!")]
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    assert detok.push([ids[0]]) == "a "
    assert detok.push([ids[1]]) == "STAR"
    assert detok.push([ids[2]]) == "!"
    assert detok.finish(None) == ""


def test_held_back_stop_prefix_is_flushed_on_a_non_stop_finish():
    tok = ByteTokenizer()
    ids = [tok.add(b"x ST")]
    deltas = run(
        IncrementalDetokenizer(tok, stop=["STOP"]), ids, matched=None
    )  # e.g. a length finish
    assert deltas == ["x ", "ST"]


def test_no_stop_trim_keeps_the_stop_string():
    tok = ByteTokenizer()
    ids = [tok.add(b"one "), tok.add(b"END"), tok.add(b" two")]
    deltas = run(IncrementalDetokenizer(tok, stop=["END"], trim_stop=False), ids[:2], matched="END")
    assert "".join(deltas) == "one END"


def test_several_stop_strings_earliest_wins():
    tok = ByteTokenizer()
    ids = [tok.add(b"abc"), tok.add(b"###"), tok.add(b"xyz")]
    deltas = run(IncrementalDetokenizer(tok, stop=["xyz", "##"]), ids, matched="##")
    assert "".join(deltas) == "abc"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from tests.helpers.checkpoints import smollm2_tokenizer_dir

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


def test_real_tokenizer_cjk_and_emoji(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT)
    # the test only means something if some tokens carry part of a character
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.finish(None)]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == TEXT


def test_real_tokenizer_stop_string_in_cjk(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("前言 😀 世界 结束 more")
    detok = IncrementalDetokenizer(tok, stop=["世界"])
    deltas = [detok.push([i]) for i in ids] + [detok.finish("世界")]
    assert "".join(deltas) == "前言 😀 "
