"""The small tokenizer a synthetic GGUF carries: a byte-level BPE trained (by the `tokenizers`
library) on a fixed text, the special tokens and chat template of the model family, and unused
padding tokens up to the model's vocabulary size. Deterministic: same input, same vocabulary."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gguf import GGUFValueType, TokenType
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..gguf_source import MetadataField

BPE_VOCAB = 1024  # trained tokens (bytes and merges), before specials and padding

# Training text: plain English and code-ish lines so that common words become single tokens.
CORPUS = """\
An expert pack keeps every routed expert of a mixture-of-experts model on a fast solid state disk.
The storage daemon reads the experts each token needs and hands them to the worker, which keeps the
hot ones in graphics memory and runs the model. Nothing is pruned, merged or re-quantized: the bytes
on the disk are the bytes the model was trained and quantized with, and the answer is the same.
Hello world, this is a test of the expert pack. The quick brown fox jumps over the lazy dog.
What is the capital of France? The capital of France is Paris. Tell me a story about a robot.
Write a short poem about the sea. Summarize the film in two sentences. Suggest a fun activity.
def main(argv=None) -> int: return 0  # a function that returns zero when it succeeds
for i in range(10): print(i, i * i, "squares", [x for x in range(i)], {"key": "value"})
The user asks a question, the assistant answers it, and the system sets the rules of the chat.
One two three four five six seven eight nine ten eleven twelve, hundred, thousand, million.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday, January February March April May June.
"""


@dataclass(frozen=True)
class Family:
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    add_bos: bool
    chat_template: str


FAMILIES: dict[str, Family] = {
    "chatml": Family(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", False,
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ),
    "deepseek": Family(
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", True,
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
        "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
    ),
    # Kimi-K2's vocabulary (K3 reuses it); K3's turn end <|end_of_msg|> is the eos, as its converter
    # writes it. The template is K2's plain form, not K3's tag-based one (no tools or images here).
    "kimi": Family(
        ("[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
         "<|end_of_msg|>"),
        "[BOS]", "<|end_of_msg|>", False,
        "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|end_of_msg|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}",
    ),
    "harmony": Family(
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>"),
        "<|startoftext|>", "<|return|>", False,
        "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}",
    ),
}


def tokenizer_fields(family: str, pre: str, n_vocab: int) -> list[MetadataField]:
    """GGUF tokenizer.* metadata with exactly n_vocab tokens."""
    fam = FAMILIES[family]
    tokens, merges = _train(min(BPE_VOCAB, n_vocab - len(fam.specials)))
    types = [TokenType.NORMAL] * len(tokens)
    for s in fam.specials:
        tokens.append(s)
        types.append(TokenType.CONTROL)
    if len(tokens) > n_vocab:
        raise ValueError(f"vocabulary of {n_vocab} is too small for {len(tokens)} trained and special tokens")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"<|synth_unused_{i}|>")
        types.append(TokenType.UNUSED)
    ids = {t: i for i, t in enumerate(tokens)}
    fields = [
        MetadataField("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING),
        MetadataField("tokenizer.ggml.pre", pre, GGUFValueType.STRING),
        MetadataField("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        MetadataField("tokenizer.ggml.token_type", [int(t) for t in types], GGUFValueType.ARRAY, GGUFValueType.INT32),
        MetadataField("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY, GGUFValueType.STRING),
    ]
    if fam.bos is not None:
        fields.append(MetadataField("tokenizer.ggml.bos_token_id", ids[fam.bos], GGUFValueType.UINT32))
    fields += [
        MetadataField("tokenizer.ggml.eos_token_id", ids[fam.eos], GGUFValueType.UINT32),
        MetadataField("tokenizer.ggml.padding_token_id", ids[fam.eos], GGUFValueType.UINT32),
        MetadataField("tokenizer.ggml.add_bos_token", fam.add_bos, GGUFValueType.BOOL),
        MetadataField("tokenizer.chat_template", fam.chat_template, GGUFValueType.STRING),
    ]
    return fields


def _train(vocab_size: int) -> tuple[list[str], list[str]]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges
