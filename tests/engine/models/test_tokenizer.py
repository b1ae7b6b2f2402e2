import pytest

from kvledger.engine.models.registry import load_tokenizer, resolve
from kvledger.engine.models.tokenizer import TokenizerError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  leading spaces, tabs\tand\n\nnewlines  ",
    "ünïcödé and 中文 and emoji 🙂",
    '{"type": "function", "name": "read_file"}',
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_control_tokens_are_single_ids(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n").ids
    assert ids[0] == 1 and 2 in ids  # <|im_start|> = 1, <|im_end|> = 2 in SmolLM2's vocabulary
    assert tok.token_to_id("<|endoftext|>") == 0


def test_digits_are_split_one_by_one(tok):
    # llama.cpp's 'smollm' pre-tokenizer: a timestamp is one token per digit
    assert tok.encode("2026").tokens == ["2", "0", "2", "6"]


def test_cache_is_rebuilt_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = load_tokenizer("smollm2")
    cached = list((tmp_path / "kvledger" / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    cached[0].write_text("{not json")
    again = load_tokenizer("smollm2")
    assert again.encode("cache me").ids == first.encode("cache me").ids


def test_unknown_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        load_tokenizer(str(bad))


def test_the_model_file_ships_with_the_package():
    assert resolve("smollm2-135m").weights.locate().stat().st_size > 90_000_000
