"""Tokenizer of a model directory via `tokenizers` (no torch), plus its chat template."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel, DecodeStream


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.chat_template = config.get("chat_template")
        template_path = model_dir / "chat_template.jinja"
        if template_path.exists():
            self.chat_template = template_path.read_text()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own (a partial UTF-8 character shows as U+FFFD)."""
        return self._tok.decode_batch([[i] for i in token_ids], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for, exact for byte-level and byte-fallback BPE."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_token_ids:
            return piece.encode()
        byte_map = self._byte_decoder
        if byte_map is not None and all(c in byte_map for c in piece):
            return bytes(byte_map[c] for c in piece)
        if _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def decode_stream(
        self, prefix_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> DecodeStream:
        """An incremental decoder (`tokenizers.decoders.DecodeStream`) primed with a prefix."""
        return DecodeStream(ids=prefix_ids or None, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_decoder(self) -> dict[str, int] | None:
        if not isinstance(self._tok.decoder, ByteLevel):
            return None
        return {char: byte for byte, char in _bytes_to_unicode().items()}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
        )
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to 256+."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return mapping


def _token_str(value: str | dict[str, Any] | None) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
