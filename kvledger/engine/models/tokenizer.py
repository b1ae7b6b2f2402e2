"""A model's tokenizer: a tokenizer.json, or one built from the vocabulary inside a GGUF model file.

`tokenizer_from(path)` takes either (a model by name: `registry.load_tokenizer`).
Parsing a GGUF's metadata takes seconds (the reader walks every field), so the
built tokenizer is cached as a tokenizer.json under $XDG_CACHE_HOME/kvledger, keyed
by the model file's path, size and mtime. The cache is a plain JSON file (no pickle).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from kvledger.engine.models.model_files import cache_dir

_CONTROL = 3  # GGUF token type of special (control) tokens
_USER_DEFINED = 4  # GGUF token type of added tokens matched whole but not special (Gemma's <unused…>, tabs …)
_SPACE = "\u2581"  # sentencepiece's visible space "▁"


class TokenizerError(Exception):
    """The tokenizer could not be found or built."""


def tokenizer_from(source: str | Path) -> Tokenizer:
    """From a path to a .gguf file or to a tokenizer.json."""
    path = Path(source)
    if not path.is_file():
        raise TokenizerError(f"no tokenizer {str(source)!r}: give a model name, a .gguf file or a tokenizer.json")
    if path.suffix == ".gguf":
        return _from_gguf(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception subclasses
        raise TokenizerError(f"{path}: not a tokenizer.json ({e})") from None


def encode_ids(tok: Tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """`tok.encode(text).ids`, with the GIL released while it runs: `encode` holds it for the whole call (a
    megabyte: about a second in which no other thread, the event loop's included, runs), `encode_batch` not."""
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def longest_token_bytes(tok: Tokenizer) -> int:
    """The UTF-8 length of the longest vocabulary entry: no token spells more bytes of text (a byte-level
    entry has one character per byte), so text of B bytes has at least B / this many tokens."""
    return max((len(entry.encode()) for entry in tok.get_vocab(with_added_tokens=True)), default=1)


class PieceEncoder:
    """Token ids of text given in pieces, each trusted or not: a control-token string (a special added
    token, `<|im_start|>` ...) in a trusted piece is that token, in an untrusted one plain text.

    The text between the trusted pieces' control tokens is encoded as one string, so when no untrusted
    piece spells a control token the ids equal `tok.encode("".join(pieces), add_special_tokens=False)`
    (added tokens' lstrip/rstrip are not applied: SmolLM2's have none)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.plain = Tokenizer.from_str(tok.to_str())
        self.plain.encode_special_tokens = True   # a copy: the flag is the tokenizer's, shared by threads
        self.controls = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        longest_first = sorted(self.controls, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if longest_first else None

    def encode(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """`pieces`: (text, trusted) in order."""
        ids: list[int] = []
        text: list[str] = []   # plain text since the last control token
        for piece, trusted in pieces:
            parts = self.split.split(piece) if trusted and self.split is not None else [piece]
            for k, part in enumerate(parts):
                if k % 2 == 0:
                    text.append(part)
                    continue
                ids += self._plain_ids(text)
                ids.append(self.controls[part])
                text = []
        return ids + self._plain_ids(text)

    def _plain_ids(self, text: list[str]) -> list[int]:
        joined = "".join(text)
        return encode_ids(self.plain, joined, add_special_tokens=False) if joined else []


def _cache_path(gguf: Path) -> Path:
    st = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / f"{gguf.stem}-{tag}.json"


def _from_gguf(path: Path) -> Tokenizer:
    cached = _cache_path(path)
    if cached.is_file():
        try:
            return Tokenizer.from_file(str(cached))
        except Exception:
            cached.unlink(missing_ok=True)  # a damaged cache is rebuilt, never trusted
    try:
        tok = build_gguf_tokenizer(path)
    except TokenizerError:
        raise
    except Exception as e:  # gguf raises ValueError, numpy errors, KeyError... on a file that is not GGUF
        raise TokenizerError(f"{path}: not a GGUF tokenizer ({type(e).__name__}: {e})") from None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, cached)
    except OSError:
        pass  # an unwritable cache only costs the next start a few seconds
    return tok


def build_gguf_tokenizer(path: Path) -> Tokenizer:
    """A byte-level BPE tokenizer from a GGUF's `tokenizer.ggml.*` fields (model 'gpt2').

    Pre-tokenization follows llama.cpp's 'smollm' pre-type: every digit on its own,
    then the GPT-2 split. Control tokens (<|im_start|> …) are matched whole.
    """
    import gguf  # imported here: it is only needed when the cache is cold

    reader = gguf.GGUFReader(str(path))

    def field(key: str):
        f = reader.fields.get(key)
        if f is None:
            raise TokenizerError(f"{path}: no {key}")
        return f.contents()

    kind, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")
    if kind == "llama" and str(field("general.architecture")).startswith("gemma"):
        return _gemma_tokenizer(field)
    if kind != "gpt2":
        raise TokenizerError(f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', or "
                             "Gemma's sentencepiece BPE)")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre == "smollm":
        split.insert(0, pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"))
    elif pre not in ("gpt2", "default"):
        raise TokenizerError(f"{path}: pre-tokenizer {pre!r} is not supported (smollm, gpt2)")
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    return tok


def _gemma_tokenizer(field) -> Tokenizer:
    """Gemma's sentencepiece BPE (what transformers' GemmaTokenizer builds from the same GGUF), `<bos>` added.

    The GGUF lists no merges: they are rebuilt from the vocabulary, every split of a token into two tokens,
    ranked by the token's place in the file (earlier first), as transformers does for Gemma. A token made of
    spaces only is stored with real spaces and looked up as "▁"s, so it is respelled first. Spaces become
    "▁" (no prefix space); unknown bytes fall back to <0xNN> tokens. Control tokens (<bos>, <start_of_turn>
    …) are special, user-defined ones are matched whole."""
    tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in field("tokenizer.ggml.tokens")]
    types: list[int] = field("tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[field("tokenizer.ggml.unknown_token_id")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_by_rank(vocab, {t: -i for i, t in enumerate(tokens)}),
                               fuse_unk=True, unk_token=unk, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and vocab.get(t) is not None])
    bos = tokens[field("tokenizer.ggml.bos_token_id")]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, vocab[bos])])
    return tok


def _merges_by_rank(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: each token's splits into two vocabulary tokens, best rank first (ties:
    longer left piece, then longer right piece; within a token by the pieces' ids)."""
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in rank.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        for left, right in sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]])):
            found.append((score, len(left), len(right), left, right))
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)   # stable: ties keep the order above
    return [(left, right) for _, _, _, left, right in found]
