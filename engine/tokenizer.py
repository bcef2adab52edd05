"""Text <-> token ids: a byte-level tokenizer by default, ``tokenizer.json`` when a model ships one.

* ``ByteTokenizer``: ids 0..255 are the bytes of the UTF-8 text, 256 is BOS, 257 is EOS.
  Any text round-trips exactly; ids >= 258 (a model's vocabulary may be larger) decode to
  nothing. Costs O(bytes).
* ``HFTokenizer``: a ``tokenizer.json`` read by the optional ``tokenizers`` package.
* ``IncrementalDetokenizer``: turns a growing list of token ids into text deltas without
  re-decoding the whole output each step and without emitting half a UTF-8 character
  (a trailing U+FFFD means "wait for the next token").
* ``apply_chat_template``: one simple role-tagged template for every model (no Jinja);
  HF checkpoints' own chat templates are not interpreted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "IncrementalDetokenizer", "ChatMessage",
           "apply_chat_template", "load_tokenizer"]


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus BOS and EOS specials."""

    BOS = 256
    EOS = 257
    vocab_size = 258

    def __init__(self) -> None:
        self.bos_token_id: int | None = self.BOS
        self.eos_token_id: int | None = self.EOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Specials and ids past the byte range are skipped; bad UTF-8 becomes U+FFFD."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package (an optional dependency)."""

    def __init__(self, path: str | Path, bos_token_id: int | None, eos_token_id: int | None) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as exc:
            raise RuntimeError(f"{path} needs the 'tokenizers' package (pip install tokenizers); "
                               "without tokenizer.json the byte-level tokenizer is used") from exc
        self._tok = _Tokenizer.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)


def load_tokenizer(model_path: str | None, bos_token_id: int | None = None,
                   eos_token_id: int | None = None) -> Tokenizer:
    """``tokenizer.json`` of a model directory when present, the byte tokenizer otherwise."""
    if model_path is not None:
        file = Path(model_path) / "tokenizer.json"
        if file.is_file():
            config = Path(model_path) / "tokenizer_config.json"
            if config.is_file() and (bos_token_id is None or eos_token_id is None):
                raw = json.loads(config.read_text())
                tok = HFTokenizer(file, None, None)
                bos_token_id = bos_token_id if bos_token_id is not None else _special_id(tok, raw.get("bos_token"))
                eos_token_id = eos_token_id if eos_token_id is not None else _special_id(tok, raw.get("eos_token"))
            return HFTokenizer(file, bos_token_id, eos_token_id)
    return ByteTokenizer()


def _special_id(tok: HFTokenizer, token: object) -> int | None:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return tok._tok.token_to_id(token) if isinstance(token, str) else None


class IncrementalDetokenizer:
    """Text deltas for one request's output, O(window) per token rather than O(output).

    Keeps a short window ``ids[prefix:]``: decoding ``ids[prefix:read]`` and ``ids[prefix:]``
    and taking the difference yields the new text even for tokenizers whose pieces depend on
    their left neighbour (leading spaces). Text ending in U+FFFD (an incomplete UTF-8 sequence)
    is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text that became final (possibly '')."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read])
        after = decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """At the end of the output: whatever is still held back, replacement chars included."""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):]


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str


def apply_chat_template(messages: Sequence[ChatMessage]) -> str:
    """``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n`` to prompt the reply."""
    parts = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)
