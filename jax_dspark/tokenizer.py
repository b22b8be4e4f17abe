"""A chat tokenizer rebuilt from GGUF metadata with the `tokenizers` package.

GGUF files carry the vocabulary, merges, token types, special ids and a Jinja chat
template, but no tokenizer.json. For GPT-2-style byte-level BPE vocabularies
(`tokenizer.ggml.model == "gpt2"`) that is enough to rebuild the exact tokenizer:

- model: BPE over the vocabulary and merges (byte-level symbols, so no unknown token);
- pre-tokenizer: the split rule named by `tokenizer.ggml.pre`. SmolLM2 ("smollm"), like
  StarCoder, first isolates every digit, then applies GPT-2's regex; plain "gpt2" skips the
  digit split;
- control tokens (`<|im_start|>`, `<|im_end|>`, ...) registered as special added tokens, so
  the text "<|im_start|>" in a chat prompt encodes to its single id instead of 7 BPE pieces
  (the model was trained on the single ids) and `decode(..., skip_special=True)` drops them.

The chat template is ChatML written out in Python rather than rendered from the GGUF's Jinja
source (no jinja2 dependency): `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message and
`<|im_start|>assistant\\n` as the generation prompt. SmolLM2's template also inserts a
default system message when the conversation has none; its text is read from the GGUF
template so it always matches the file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatTokenizer"]

# Token types of llama.cpp's vocabulary (gguf.TokenType): 3 = CONTROL, 4 = USER_DEFINED.
_SPECIAL_TOKEN_TYPES = (3, 4)
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


class ChatTokenizer:
    """Encode / decode text and ChatML conversations for one model.

    Attributes:
      tokenizer: the underlying `tokenizers.Tokenizer`.
      bos_id: beginning-of-sequence id (SmolLM2 does not prepend it; see `add_bos`).
      eos_ids: ids that end a generated answer, the end-of-turn token first.
      vocab_size: number of ids.
      default_system: system message inserted when a conversation has none, or None.
      add_bos: whether `encode` prepends `bos_id`.
    """

    def __init__(self, tokenizer, *, bos_id: int, eos_ids: Sequence[int], default_system: str | None = None,
                 add_bos: bool = False):
        if not eos_ids:
            raise ValueError(f"eos_ids: need at least one end-of-sequence id (got {eos_ids!r})")
        self.tokenizer = tokenizer
        self.bos_id = int(bos_id)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.default_system = default_system
        self.add_bos = bool(add_bos)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> ChatTokenizer:
        """Rebuild from a GGUF metadata dict (`checkpoint.gguf.gguf_metadata`)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"meta: only byte-level BPE ('gpt2') vocabularies are supported (got {kind!r})")
        pre = meta.get("tokenizer.ggml.pre", "gpt2")
        splits = {"gpt2": [], "smollm": [pre_tokenizers.Digits(individual_digits=True)],
                  "starcoder": [pre_tokenizers.Digits(individual_digits=True)]}
        if pre not in splits:
            raise ValueError(f"meta: tokenizer.ggml.pre must be one of {sorted(splits)} (got {pre!r})")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError(f"meta: vocabulary has duplicate tokens ({len(tokens) - len(vocab)} of them)")

        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            splits[pre] + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty in _SPECIAL_TOKEN_TYPES]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

        eos = int(meta["tokenizer.ggml.eos_token_id"])
        eos_ids = [eos] + [vocab[t] for t in ("<|endoftext|>",) if t in vocab and vocab[t] != eos]
        template = meta.get("tokenizer.chat_template") or ""
        found = _DEFAULT_SYSTEM.search(template)
        return cls(
            tok,
            bos_id=int(meta.get("tokenizer.ggml.bos_token_id", eos)),
            eos_ids=eos_ids,
            default_system=found.group(1) if found else None,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token strings in it become their single ids."""
        if not isinstance(text, str):
            raise ValueError(f"text: must be a str (got {type(text).__name__})")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if self.add_bos else ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless `skip_special=False`."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The ChatML text of a conversation (see the module docstring)."""
        if not messages:
            raise ValueError(f"messages: need at least one message (got {messages!r})")
        parts = []
        if messages[0].get("role") != "system" and self.default_system is not None:
            parts.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
        for i, message in enumerate(messages):
            if "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}]: needs 'role' and 'content' (got {dict(message)!r})")
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> list[int]:
        """Ids of `render_chat(messages)`, ready to prefill."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt))
