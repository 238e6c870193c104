"""IncrementalDetokenizer against real tokenizers: byte-level BPE (SmolLM2) and
SentencePiece with byte fallback (Gemma 3)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.detokenizer import IncrementalDetokenizer

MODELS = ("smollm2-135m-instruct", "gemma-3-270m")
SAMPLES = (
    "Hello world",
    "The café served crème brûlée; naïve façade, Ångström.",
    "emoji 🙂🎉 and flags 🇫🇷, family 👨‍👩‍👧 ok",
    "中文测试，日本語のテキスト，한국어 문장",
    "  leading spaces,   runs   of spaces  and trailing  ",
    "line one\nline two\n\n\nafter blank lines\r\n\ttab",
    "mixed: ∑x² ≤ ∞ → ☃ ✓ €100 ½",
)
_TOKENIZERS: dict[str, object] = {}


def _model_dir(name: str) -> Path | None:
    try:
        from engine.model_cache import cached_model_dir
    except ImportError:
        path = Path("/tmp/conv") / name
    else:
        path = Path(cached_model_dir(name))
    return path if (path / "tokenizer.json").exists() else None


@pytest.fixture(params=MODELS)
def tokenizer(request):
    name = request.param
    if name not in _TOKENIZERS:
        path = _model_dir(name)
        if path is None:
            pytest.skip(f"no converted tokenizer for {name}")
        from transformers import AutoTokenizer

        _TOKENIZERS[name] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[name]


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _byte_ids(tok, text: str) -> list[int]:
    """Gemma's byte-fallback ids, one per UTF-8 byte of text."""
    return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])


def _is_gemma(tok) -> bool:
    return len(tok) > 200_000


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str]:
    """Feeds ids until a stop matches; returns (deltas, flushed tail)."""
    deltas = []
    for i in ids:
        delta, matched = detok.append(i)
        deltas.append(delta)
        if matched is not None:
            return deltas, ""
    return deltas, detok.flush()


@pytest.mark.parametrize("prompt", ["", "User: say something.\nAssistant:"])
@pytest.mark.parametrize("sample", SAMPLES)
def test_deltas_concatenate_to_decode(tokenizer, prompt, sample):
    ids = _encode(tokenizer, sample)
    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, prompt))
    deltas, tail = _run(detok, ids)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == sample
    assert detok.text == sample
    assert not any("\ufffd" in d for d in deltas)  # no partial character ever emitted


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_decode(tokenizer, skip):
    # Arbitrary ids (partial bytes, special and unused tokens included): the
    # windowed decode must agree with one decode of the whole output.
    rng = random.Random(0)
    prompt = _encode(tokenizer, "Once upon a time")
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(64)]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        deltas, tail = _run(detok, ids)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = _encode(tokenizer, "Hi") + [eos, eos] + _encode(tokenizer, " there")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        deltas, tail = _run(detok, ids)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
    # A long run of skipped tokens does not grow the decode window.
    detok = IncrementalDetokenizer(tokenizer, [])
    for _ in range(100):
        detok.append(eos)
    assert len(detok._ids) <= 1


def test_multibyte_char_split_across_tokens_is_held(tokenizer):
    if _is_gemma(tokenizer):
        ids = _byte_ids(tokenizer, "🙂")  # <0xF0><0x9F><0x99><0x82>
    else:
        ids = _encode(tokenizer, "🙂")  # byte-level: two tokens of two bytes each
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, "Smile:"))
    deltas = [detok.append(i)[0] for i in ids]
    assert deltas == [""] * (len(ids) - 1) + ["🙂"]
    assert detok.flush() == ""


def test_flush_emits_incomplete_character_like_decode(tokenizer):
    ids = _encode(tokenizer, "ok") + (_byte_ids(tokenizer, "🙂")[:2] if _is_gemma(tokenizer) else [])
    if not _is_gemma(tokenizer):
        ids += tokenizer.convert_tokens_to_ids(["ĠðŁ"])  # " " + two bytes of an emoji
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, tail = _run(detok, ids)
    assert "".join(deltas) == "ok"
    assert tail.endswith("\ufffd")
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert detok.flush() == ""  # idempotent
    with pytest.raises(RuntimeError):
        detok.append(ids[0])


def test_prompt_ending_inside_a_character(tokenizer):
    if not _is_gemma(tokenizer):
        pytest.skip("needs byte-fallback tokens")
    emoji = _byte_ids(tokenizer, "🙂")
    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, "Smile") + emoji[:2])
    deltas, tail = _run(detok, emoji[2:] + _encode(tokenizer, " ok"))
    assert "".join(deltas) + tail == "🙂 ok"


def test_invalid_bytes_do_not_stall(tokenizer):
    if not _is_gemma(tokenizer):
        pytest.skip("needs byte-fallback tokens")
    ids = tokenizer.convert_tokens_to_ids(["<0x80>"]) * 30 + _encode(tokenizer, "x")
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, tail = _run(detok, ids)
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert "".join(deltas).startswith("\ufffd" * 8)  # emitted before the run ends


def _tokens_of(tok, text: str, pieces: list[str]) -> list[int]:
    """Ids of text encoded piece by piece, so the token boundaries are known."""
    ids = [i for p in pieces for i in _encode(tok, p)]
    assert tok.decode(ids) == text
    return ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_cut_exactly(tokenizer, include):
    ids = _tokens_of(tokenizer, "Hello world, more", ["Hello", " world", ",", " more"])
    detok = IncrementalDetokenizer(tokenizer, [], stop=("o w",), include_stop_str_in_output=include)
    deltas, tail = _run(detok, ids)
    assert detok.matched_stop == "o w"
    assert "".join(deltas) + tail == ("Hello w" if include else "Hell")
    assert detok.text == "".join(deltas)
    assert len(deltas) == 2  # nothing fed after the match
    with pytest.raises(RuntimeError):
        detok.append(ids[-1])
    assert detok.flush() == ""


def test_stop_prefix_is_held_until_resolved(tokenizer):
    stop = ("\n\nUser",)
    ids = _tokens_of(tokenizer, "abc\n\nUser: hi", ["abc", "\n\n", "Us", "er", ": hi"])
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
    emitted = ""
    for i in ids:
        delta, matched = detok.append(i)
        emitted += delta
        assert emitted == "abc"  # "\n\nUs" is never emitted early
        if matched:
            break
    assert matched == "\n\nUser"
    # A near miss releases the held text once it can no longer match.
    ids = _tokens_of(tokenizer, "abc\n\nUsage", ["abc", "\n\n", "Us", "age"])
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
    deltas = [detok.append(i) for i in ids]
    assert [d for d, _ in deltas][:3] == ["abc", "", ""]
    assert "".join(d for d, _ in deltas) == "abc\n\nUsage"
    assert all(m is None for _, m in deltas)


def test_text_includes_held_stop_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    delta = "".join(detok.append(i)[0] for i in _encode(tokenizer, "go ST"))
    assert detok.text == "go ST"
    assert delta == "go "
    assert detok.flush() == "ST"  # finishing by length releases the held prefix


def test_first_completed_stop_wins_whatever_the_tokenization(tokenizer):
    # " world" is one token, so both stop strings complete in the same delta;
    # fed char by char, "or" completes first, and that must decide either way.
    stops = ("world", "or", "zz")
    text = "Hello world!"
    whole = IncrementalDetokenizer(tokenizer, [], stop=stops)
    by_char = IncrementalDetokenizer(tokenizer, [], stop=stops)
    whole_out = "".join(_run(whole, _tokens_of(tokenizer, text, ["Hello", " world", "!"]))[0])
    by_char_out = "".join(_run(by_char, _tokens_of(tokenizer, text, list(text)))[0])
    assert whole_out == by_char_out == "Hello w"
    assert whole.matched_stop == by_char.matched_stop == "or"


def test_stop_completed_by_flush(tokenizer):
    # Byte-level BPE has tokens like "ĠðŁ": a space plus two bytes of an emoji.
    # Its " " waits behind the incomplete character; only flush() reveals that
    # "x " completed the stop string. (Gemma's byte tokens carry one byte each,
    # so a complete character never shares a token with an incomplete one.)
    if _is_gemma(tokenizer):
        pytest.skip("needs a token mixing a complete and an incomplete character")
    ids = _encode(tokenizer, "x") + tokenizer.convert_tokens_to_ids(["ĠðŁ"])
    detok = IncrementalDetokenizer(tokenizer, [], stop=("x ",))
    assert [detok.append(i) for i in ids] == [("", None), ("", None)]
    assert detok.flush() == ""
    assert detok.matched_stop == "x "
    assert detok.text == ""


def test_empty_stop_string_rejected(tokenizer):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, [], stop=("",))
