"""The tokenizer rebuilt from GGUF metadata reproduces the reference prompt ids (made by each model's
own HF tokenizer) for byte-level BPE with five different pre-tokenizers (the flagship fixtures'
deepseek-v3 and kimi-k2 among them) and for a SentencePiece vocabulary, and round-trips text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertpack.packtools.gguf_source import open_source
from expertpack.worker.serve.tokenizer import TokenizerError, load_tokenizer

from ..conftest import FIXTURES

CASES = {  # model -> (GGUF, what its vocabulary is)
    "qwen3moe-a": ("qwen3moe-a.Q2_K.gguf", "BPE, qwen2 pre-tokenizer, NFC"),
    "deepseek3-a": ("deepseek3-a.Q2_K.gguf", "BPE, deepseek-v3's three splits, BOS added"),
    "gptoss-a": ("gptoss-a.MXFP4.gguf", "BPE, o200k (gpt-4o) pre-tokenizer"),
    "mixtral-a": ("mixtral-a.Q2_K.gguf", "SentencePiece BPE with byte fallback, BOS added"),
}


def metadata(model: str) -> dict:
    source = open_source(FIXTURES / "gguf" / model / CASES[model][0])
    return {k: f.value for k, f in source.metadata.items()}


@pytest.mark.parametrize("model", sorted(CASES))
def test_prompt_ids_equal_the_models_own_tokenizer(model: str) -> None:
    tok = load_tokenizer(metadata(model))
    hf = json.loads((FIXTURES / "ref" / model / "hf_ref.json").read_text())
    assert tok.encode(hf["prompt_text"]) == np.load(FIXTURES / "ref" / model / "prompt_ids.npy").tolist()


@pytest.mark.parametrize("gguf", ["deepseek4/dsv4-tiny.Q2_K.gguf", "kimi-k3/k3-tiny.Q2_K.gguf"])
def test_flagship_prompt_ids_equal_the_references(gguf: str) -> None:
    path = FIXTURES / "flagship" / gguf
    tok = load_tokenizer({k: f.value for k, f in open_source(path).metadata.items()})
    ref = json.loads((path.parent / "reference.json").read_text())
    for prompt in ref["prompts"].values():  # the texts spell out their BOS
        assert tok.encode(prompt["text"], add_special=False) == prompt["ids"]
        assert tok.decode(tok.encode("ünïcödé – 東京 and 12345")) == "ünïcödé – 東京 and 12345"


@pytest.mark.parametrize("model", sorted(CASES))
def test_text_round_trips(model: str) -> None:
    tok = load_tokenizer(metadata(model))
    for text in ("Hello world, this is a test.", "numbers 12345 and CAPS and   spaces", "ünïcödé – 東京"):
        assert tok.decode(tok.encode(text)) == text


def test_unknown_pre_tokenizer_is_refused_with_a_way_out() -> None:
    md = metadata("qwen3moe-a") | {"tokenizer.ggml.pre": "martian"}
    with pytest.raises(TokenizerError, match="--tokenizer DIR"):
        load_tokenizer(md)


def test_hf_tokenizer_directory_overrides(tmp_path) -> None:
    tok = load_tokenizer(metadata("qwen3moe-a"), FIXTURES / "hf" / "qwen3moe-a")
    hf = json.loads((FIXTURES / "ref" / "qwen3moe-a" / "hf_ref.json").read_text())
    assert tok.encode(hf["prompt_text"]) == np.load(FIXTURES / "ref" / "qwen3moe-a" / "prompt_ids.npy").tolist()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(metadata("qwen3moe-a"), tmp_path)
