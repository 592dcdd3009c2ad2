"""The tokenizer a GGUF carries, rebuilt with the `tokenizers` library: byte-level BPE
(`tokenizer.ggml.model = gpt2`) with the pre-tokenizer `tokenizer.ggml.pre` names, or a
SentencePiece-style BPE (`llama`) whose merges follow from the token scores. An HF tokenizer
directory (tokenizer.json) may be given instead and then wins. TokenTexts spells one token as
logprobs show it: its bytes, and its text or `bytes:\\xNN...`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_BYTE = 3, 4, 6

# tokenizer.ggml.pre -> (regexes split in turn, NFC normalization), as llama.cpp and the models'
# own tokenizer.json define them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi-K2/K3: o200k's shape with runs of Han characters split off first (`&&` intersects classes).
_KIMI_K2 = (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
            r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
            r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2,), False),
    "gpt-2": ((_GPT2,), False),
    "qwen2": ((_QWEN2,), True),
    "llama-bpe": ((_LLAMA3,), False),
    "gpt-4o": ((_O200K,), False),
    "deepseek-v3": (_DEEPSEEK3, False),
    "kimi-k2": ((_KIMI_K2,), False),
}


class TokenizerError(ValueError):
    pass


@dataclass
class GGUFTokenizer:
    tok: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    stop_ids: frozenset[int]  # tokens that end a generation (eos and the end-of-turn controls)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


def load_tokenizer(metadata: dict[str, Any], override_dir: Path | None = None) -> GGUFTokenizer:
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if override_dir is not None:
        path = Path(override_dir) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{override_dir}: no tokenizer.json")
        tok = Tokenizer.from_file(str(path))
    else:
        kind = metadata.get("tokenizer.ggml.model")
        if kind == "gpt2":
            tok = _byte_level_bpe(metadata, tokens, types)
        elif kind == "llama":
            tok = _sentencepiece_bpe(metadata, tokens, types)
        else:
            raise TokenizerError(f"tokenizer model {kind!r} is not supported (gpt2, llama); pass an HF "
                                 "tokenizer directory instead")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind_adds_bos(metadata)))
    stops = {eos} if eos is not None else set()
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        stops.add(eot)
    for i, (text, t) in enumerate(zip(tokens, types)):
        if t == TOKEN_CONTROL and text in ("<|im_end|>", "<|end|>", "<|return|>", "<|eot_id|>", "<|endoftext|>"):
            stops.add(i)
    return GGUFTokenizer(tok, bos, eos, add_bos, frozenset(stops))


def kind_adds_bos(metadata: dict[str, Any]) -> bool:
    return metadata.get("tokenizer.ggml.model") == "llama"


def _specials(tokens: list[str], types: list[int]) -> list[AddedToken]:
    return [AddedToken(text, special=(t == TOKEN_CONTROL), normalized=False)
            for text, t in zip(tokens, types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"pre-tokenizer {pre!r} is not known here ({', '.join(PRE_TOKENIZERS)}); "
                             "pass the model's HF tokenizer directory (--tokenizer DIR)")
    regexes, nfc = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(_specials(tokens, types))
    return tok


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    """SentencePiece BPE: merges in the order of the merged piece's score (what sentencepiece
    applies), byte fallback through the <0xXX> tokens, spaces as U+2581 with one prepended."""
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((score, vocab[left], vocab[right], left, right))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    unk = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(c[3], c[4]) for c in candidates], unk_token=tokens[unk],
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_tokens(_specials(tokens, types))
    return tok


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE's vocabulary writes each byte as one printable character (GPT-2's
    bytes_to_unicode): the printable Latin-1 bytes as themselves, the others from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _gpt2_byte_decoder()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback tokens


class TokenTexts:
    """What logprobs show of a token: its bytes (UTF-8; a token may hold part of a character) and
    its text, which OpenAI writes as `bytes:\\xNN...` when the bytes are not whole UTF-8."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tok = tokenizer.tok
        self.byte_level = isinstance(self.tok.decoder, decoders.ByteLevel)
        self.added = set(self.tok.get_added_tokens_decoder())
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        if token not in self._bytes:
            piece = self.tok.id_to_token(token) or ""
            if token in self.added:
                raw = piece.encode()
            elif self.byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
            elif match := _BYTE_PIECE.fullmatch(piece):
                raw = bytes([int(match.group(1), 16)])
            else:
                raw = piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary is a space
            self._bytes[token] = raw
        return self._bytes[token]

    def text_of(self, token: int) -> str:
        raw = self.bytes_of(token)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
