"""Tokenizers behind one interface: `tokenizer.json` (byte-level BPE: SmolLM2, Llama-3) through the `tokenizers`
library, and sentencepiece `tokenizer.model` (Llama-1/2, Vicuna). BOS/EOS rules and the chat template come from the
model folder. `StreamDecoder` turns token ids into text incrementally without ever emitting a broken UTF-8 character.
"""

import json
import re
from pathlib import Path

from tr_engine import checks
from tr_engine.errors import InvalidType, InvalidValue, UserError
from tr_engine.model.chat_template import ChatTemplate


class Tokenizer:
    """encode/decode plus the special ids the decode loop needs."""

    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    vocab_size: int
    chat_template: ChatTemplate

    # Special-token strings written inside a message's content ("<|im_start|>system…") are text, as OpenAI's API reads
    # them: a user cannot close their own turn and open a system one. True reads them as the control tokens (the old
    # behaviour: --parse-special-tokens).
    parse_special: bool = False
    special_re: re.Pattern | None = None  # the special-token strings encode() turns into their ids

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. '<|im_start|>') become their ids."""
        raise NotImplementedError

    def encode_text(self, text: str, first: bool) -> list[int]:
        """Token ids of `text` with special-token strings spelled out as text (`first`: it starts the prompt)."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render `messages` ([{'role', 'content'}, …]) with the model's chat template and tokenize the result; the
        template's special tokens are control tokens, and those written in a message's content text (unless
        `parse_special`)."""
        text = self.chat_template.render(messages, add_generation_prompt)
        # Templates that start with the BOS text already carry it; otherwise follow the tokenizer's own rule.
        add_bos = self.add_bos and not text.startswith(self.chat_template.bos_token or "\0")
        forged = [m["content"] for m in messages
                  if self.special_re is not None and self.special_re.search(m["content"])]
        if self.parse_special or not forged:
            return self.encode(text, add_bos=add_bos)
        # Each content that holds special-token strings is encoded as text, the template around it as before (a
        # template's specials split the text anyway: the parts between them are tokenized apart in either case).
        ids, at = ([self.bos_id] if add_bos else []), 0
        for content in forged:
            start = text.find(content, at)
            if start < 0:
                raise InvalidValue("a message's content holds special-token strings and this model's chat template "
                                   "changes the content, so they cannot be kept as text; remove them, or allow them "
                                   "as control tokens with --parse-special-tokens")
            ids += self.encode(text[at:start], add_bos=False) + self.encode_text(content, first=start == 0)
            at = start + len(content)
        return ids + self.encode(text[at:], add_bos=False)

    def prompt_ids(self, prompt: str | list[dict], chat_template: bool = True) -> list[int]:
        """A prompt's ids, checked: a string (wrapped as one user message unless chat_template=False) or messages
        ([{'role': str, 'content': str}, …]); anything else is refused with an InvalidType or InvalidValue."""
        checks.flag(chat_template, "chat_template")
        if isinstance(prompt, str):
            checks.text(prompt, "the prompt")
            if not prompt.strip():
                raise InvalidValue("the prompt is empty; give some text to answer")
            if not chat_template:
                return self.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        elif not isinstance(prompt, (list, tuple)):
            raise InvalidType(f"the prompt must be a string or a list of messages, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidValue("the conversation has no messages; give at least one {'role': 'user', 'content': …}")
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not {"role", "content"} <= m.keys():
                raise InvalidType(f"message {i} must be a dict with 'role' and 'content', got "
                                  f"{type(m).__name__ if not isinstance(m, dict) else sorted(m)}")
            checks.text(m["role"], f"message {i}'s role")
            checks.text(m["content"], f"message {i}'s content")
        if not chat_template:
            raise InvalidValue("chat_template=False takes a prompt string, not messages")
        return self.encode_chat([{"role": m["role"], "content": m["content"]} for m in prompt])

    def fingerprint(self) -> str:
        """A short hash of the tokenizer file: what a saved recycling matrix is checked against."""
        import hashlib

        return hashlib.sha256(self.source.read_bytes()).hexdigest()[:16]


def _read_tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-download or regenerate it")


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens either as strings or as {'content': …} objects."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` run by Hugging Face's `tokenizers` library (byte-level BPE and friends)."""

    def __init__(self, folder: Path, config: dict, eos_ids: tuple[int, ...]):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self.source = folder / "tokenizer.json"
            self.tok = RustTokenizer.from_file(str(self.source))
        except Exception as e:  # the library raises a bare Exception for corrupt files
            raise UserError(f"{folder / 'tokenizer.json'} cannot be read ({e}); re-download or regenerate it")
        bos = _token_text(config.get("bos_token"))
        self.bos_id = self.tok.token_to_id(bos) if bos else None
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_id is not None
        eos = _token_text(config.get("eos_token"))
        extra = (self.tok.token_to_id(eos),) if eos and self.tok.token_to_id(eos) is not None else ()
        self.eos_ids = tuple(dict.fromkeys(eos_ids + extra))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = ChatTemplate.from_config(folder, config, bos or "", eos or "")
        specials = [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special]
        self.special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.as_text = RustTokenizer.from_file(str(self.source))  # (a second one: the switch is the tokenizer's)
        self.as_text.encode_special_tokens = True  # special-token strings spelled out as text

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids if text else []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_text(self, text: str, first: bool) -> list[int]:
        return self.as_text.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `tokenizer.model` (Llama-1/2, Vicuna), tokenizing as Hugging Face's Llama tokenizer does:
    special-token strings in the text are split out and mapped to their ids (sentencepiece alone would spell them
    out), and only the start of the text gets sentencepiece's dummy-prefix space, and only when it does not already
    start with a space (transformers >= 5; raw sentencepiece would write two), unless tokenizer_config.json says
    `"legacy": true` (then every piece after a special token gets one too).
    """

    def __init__(self, folder: Path, config: dict, eos_ids: tuple[int, ...]):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor()
        self.source = folder / "tokenizer.model"
        try:
            self.sp.Load(str(folder / "tokenizer.model"))
        except (OSError, RuntimeError) as e:
            raise UserError(f"{folder / 'tokenizer.model'} cannot be read ({e}); re-download it")
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.add_bos = bool(config.get("add_bos_token", True)) and self.bos_id is not None
        sp_eos = (self.sp.eos_id(),) if self.sp.eos_id() >= 0 else ()
        self.eos_ids = tuple(dict.fromkeys(eos_ids + sp_eos))
        self.vocab_size = self.sp.GetPieceSize()
        self.legacy = bool(config.get("legacy", False))
        # Encoding "<unk>" + text and dropping the pieces of "<unk>" encodes text without the dummy prefix.
        self.unk_text = self.sp.IdToPiece(self.sp.unk_id())
        self.unk_len = len(self.sp.encode(self.unk_text))
        self.specials = {self.sp.IdToPiece(i): i for i in range(self.vocab_size)
                         if self.sp.IsControl(i) or self.sp.IsUnknown(i)}
        self.special_re = re.compile("(" + "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
                                     + ")") if self.specials else None
        bos = self.sp.IdToPiece(self.bos_id) if self.bos_id is not None else ""
        eos = self.sp.IdToPiece(self.sp.eos_id()) if self.sp.eos_id() >= 0 else ""
        self.chat_template = ChatTemplate.from_config(folder, config, bos, eos)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = [self.bos_id] if (self.add_bos if add_bos is None else add_bos) else []
        for i, part in enumerate(self.special_re.split(text) if self.specials else [text]):
            if part in self.specials:
                ids.append(self.specials[part])
            elif part:
                ids += self.encode_text(part, first=i == 0)
        return ids

    def encode_text(self, text: str, first: bool) -> list[int]:
        if not text:
            return []
        if (first and not text.startswith(" ")) or self.legacy:  # (sentencepiece alone spells specials out)
            return self.sp.encode(text)
        return self.sp.encode(self.unk_text + text)[self.unk_len :]

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))


def load_tokenizer(folder: str | Path, eos_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The tokenizer of a model folder: tokenizer.json if present, else sentencepiece tokenizer.model."""
    folder = Path(folder)
    config = _read_tokenizer_config(folder)
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder, config, eos_ids)
    if (folder / "tokenizer.model").is_file():
        return SentencePieceTokenizer(folder, config, eos_ids)
    raise UserError(f"{folder} has no tokenizer.json or tokenizer.model; copy the tokenizer files into the model "
                    "folder")


class StreamDecoder:
    """Incremental detokenisation, the one way generated ids become text as they come: feed ids as they are
    accepted, get back only complete new text. End-of-sequence ids are not text: they are dropped.

    Decodes a short window of recent ids and emits the part that grew; text ending in U+FFFD (a partial UTF-8
    sequence split across tokens) is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prefix_ids: list[int] = ()):
        self.tok = tokenizer
        self.ids = list(prefix_ids)[-4:]  # context so word-initial spaces decode as they would mid-text
        self.emitted = len(self.tok.decode(self.ids)) if self.ids else 0

    def texts(self, steps):
        """Yield the text of a decode loop's committed ids (`steps` yields lists of them) as it completes; return
        what the loop returns."""
        while True:
            try:
                piece = self.push(next(steps))
            except StopIteration as end:
                result = end.value
                break
            if piece:
                yield piece
        tail = self.flush()
        if tail:
            yield tail
        return result

    def take(self, new_ids: list[int], end: bool = False) -> str:
        """push(new_ids), and at the `end` the text held back too (flush)."""
        return self.push(new_ids) + (self.flush() if end else "")

    def push(self, new_ids: list[int]) -> str:
        self.ids += [t for t in new_ids if t not in self.tok.eos_ids]
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        out = text[self.emitted :]
        # Keep the window short: restart it from the last few ids once everything is emitted.
        keep = self.ids[-4:]
        self.ids, self.emitted = keep, len(self.tok.decode(keep))
        return out

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        out = text[self.emitted :]
        self.ids, self.emitted = [], 0
        return out
