"""engine/text_decoder.py: the saved tokenizers-backend decoder gives transformers' text exactly,
a start that finds no state (or a damaged one) loads through transformers and saves it."""
from __future__ import annotations

import pytest
import torch

from engine import text_decoder
from engine.model_cache import cached_model_dir

pytestmark = pytest.mark.slow  # loads the embedded models' tokenizers


@pytest.fixture(scope="module")
def dirs():
    """The embedded models' directories, resolved in the real cache (before `cache` moves it)."""
    return {m: cached_model_dir(m) for m in ("smollm2-135m-instruct", "gemma-3-270m")}


@pytest.fixture
def cache(dirs, tmp_path, monkeypatch):
    """A fresh cache root for the saved tokenizer states."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_saved_decoder_gives_transformers_text(dirs, cache, model):
    from transformers import AutoTokenizer

    model_dir = dirs[model]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    first = text_decoder.load_decoder(model_dir)  # nothing saved yet: transformers' tokenizer, saved now
    assert not isinstance(first, text_decoder.BackendDecoder)
    path = text_decoder.state_path(model_dir)
    assert path is not None and path.exists() and path.parent.parent == cache
    dec = text_decoder.load_decoder(model_dir)
    assert isinstance(dec, text_decoder.BackendDecoder)
    g = torch.Generator().manual_seed(0)
    text = "Hello, world! Ünïcödé 漢字 <|im_start|> tabs\tand\nnewlines  spaces  "
    seqs = [tok(text).input_ids]
    if tok.chat_template:  # (Gemma 3 270M has none)
        seqs.append(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
    seqs += [torch.randint(0, len(tok), (40,), generator=g).tolist() for _ in range(20)]
    for ids in seqs:
        for skip in (False, True):
            assert dec.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            # one token at a time, as the detokenizer grows its text
            assert dec.decode(ids[:7], skip) == tok.decode(ids[:7], skip_special_tokens=skip,
                                                            clean_up_tokenization_spaces=False)
    with pytest.raises(ValueError, match="clean_up"):
        dec.decode(seqs[0], clean_up_tokenization_spaces=True)


def test_a_damaged_state_loads_through_transformers_and_is_saved_again(dirs, cache):
    model_dir = dirs["smollm2-135m-instruct"]
    text_decoder.load_decoder(model_dir)
    path = text_decoder.state_path(model_dir)
    path.write_text("{not json")
    dec = text_decoder.load_decoder(model_dir)
    assert not isinstance(dec, text_decoder.BackendDecoder)
    assert isinstance(text_decoder.load_decoder(model_dir), text_decoder.BackendDecoder)


def test_another_tokenizer_file_gets_another_key(dirs, cache, tmp_path):
    import shutil

    src = dirs["smollm2-135m-instruct"]
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, copy / f.name)
    assert text_decoder.state_path(copy) == text_decoder.state_path(src)  # weights are not part of the key
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + "\n")
    assert text_decoder.state_path(copy) != text_decoder.state_path(src)
