"""Tokenizer, chat template and incremental detokenisation.

Built on Hugging Face ``tokenizers``: from a ``tokenizer.json`` or from the vocabulary, merges
and token types stored in a GGUF file's metadata (the way llama.cpp reads them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.decoders import DecodeStream

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre`; anything else gets GPT-2's.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": [_LLAMA3_SPLIT], "llama3": [_LLAMA3_SPLIT], "smollm": [r"\p{N}", _GPT2_SPLIT]}

_CONTROL, _USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class TokenizerInfo:
    """What a model file says about its tokens besides the vocabulary."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...


class ModelTokenizer:
    def __init__(self, tokenizer: Tokenizer, info: TokenizerInfo):
        self.tokenizer = tokenizer
        self.info = info
        self.eos_token_ids = info.eos_token_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = _compile_template(info.chat_template) if info.chat_template else None
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> ModelTokenizer:
        """From GGUF metadata (``tokenizer.ggml.*``): byte-level BPE (``gpt2``), or Gemma's
        SentencePiece BPE (``llama`` in a ``gemma*`` file)."""
        kind = fields.get("tokenizer.ggml.model")
        arch = str(fields.get("general.architecture", ""))
        tokens = fields["tokenizer.ggml.tokens"]
        types = fields.get("tokenizer.ggml.token_type") or []
        if kind == "gpt2":
            tk = _with_file_tokens(_byte_level_bpe(fields, tokens), tokens, types)
        elif kind == "llama" and arch.startswith("gemma"):
            unk = fields.get("tokenizer.ggml.unknown_token_id")

            def build() -> Tokenizer:
                tk, spelled = _gemma_sentencepiece(tokens, tokens[int(unk)] if unk is not None else None)
                return _with_file_tokens(tk, tokens, types, spelled)

            tk = _cached(tokens, types, build)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} of architecture {arch!r} is not supported "
                             "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece of Gemma files)")

        def token(key: str) -> int | None:
            value = fields.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None else None

        bos, eos = token("bos_token_id"), token("eos_token_id")
        eos_ids = tuple(t for t in (eos, token("eot_token_id"), token("eom_token_id")) if t is not None)
        names = {"bos_token": bos, "eos_token": eos, "unk_token": token("unknown_token_id"),
                 "pad_token": token("padding_token_id")}
        info = TokenizerInfo(
            bos_token_id=bos,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
            special_tokens={k: tokens[v] for k, v in names.items() if v is not None},
        )
        return cls(tk, info)

    @classmethod
    def from_hf_dir(cls, path: Path, generation_eos: list[int] | None = None) -> ModelTokenizer:
        """From ``tokenizer.json`` and ``tokenizer_config.json`` of a Hugging Face folder."""
        tk = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        special = {k: v for k, v in special.items() if v}
        bos = tk.token_to_id(special["bos_token"]) if "bos_token" in special else None
        eos = [tk.token_to_id(special["eos_token"])] if "eos_token" in special else []
        eos_ids = tuple(dict.fromkeys(t for t in eos + list(generation_eos or []) if t is not None))
        info = TokenizerInfo(
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
            special_tokens=special,
        )
        return cls(tk, info)

    # ---- use -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast releases the GIL (encode does not), so the router can tokenise a long
        # prompt on a thread while its event loop serves; without offsets it is no slower.
        ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.info.add_bos_token and self.info.bos_token_id is not None:
            if not ids or ids[0] != self.info.bos_token_id:
                ids = [self.info.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a single token stands for (for logprobs' ``bytes`` field); a byte-level
        token may hold part of a UTF-8 character, which decoding it alone would lose."""
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level and all(c in _BYTE_DECODER for c in token):
            return bytes(_BYTE_DECODER[c] for c in token)
        if not self._byte_level and (byte := _BYTE_FALLBACK.fullmatch(token)):  # SentencePiece's <0xE2>
            return bytes([int(byte.group(1), 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain completion instead")
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.info.special_tokens, **kwargs
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The rendered template already holds its special tokens (BOS included, when wanted).
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True, prefix_ids: list[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens, prefix_ids)


def _byte_level_bpe(fields: dict, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    splits = _SPLITS.get(fields.get("tokenizer.ggml.pre", ""), [_GPT2_SPLIT])
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    return tk


def _with_file_tokens(tk: Tokenizer, tokens: list[str], types: list[int], spelled: dict | None = None) -> Tokenizer:
    """The file's control tokens added as special tokens and its user-defined ones as plain added
    tokens (matched whole in text, as llama.cpp does); ``spelled``: only user-defined tokens the
    model's vocabulary spells that way."""
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types) if k == _CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                   if k == _USER_DEFINED and (spelled is None or t in spelled)])
    return tk


def _cached(tokens: list[str], types: list[int], build) -> Tokenizer:
    """A tokenizer that is slow to build (Gemma's 262k-token vocabulary: its merges are rebuilt in
    Python, ~10 s) from the cache ($PDSERVE_CACHE_DIR, default ~/.cache/pdserve), keyed by a digest
    of the vocabulary and of this code's version of the builder; built and stored on a miss. An
    unwritable cache only costs the build."""
    digest = hashlib.sha256(f"{_BUILDER_VERSION}\n".encode())
    for token in tokens:
        digest.update(token.encode("utf-8", "surrogatepass") + b"\0")
    digest.update(bytes(int(k) & 0xFF for k in types))
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    path = root / "tokenizers" / f"{digest.hexdigest()[:32]}.json"
    if path.exists():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # a torn or foreign file: rebuild it
            pass
    tk = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tk.save(str(tmp))
        os.replace(tmp, path)  # whole or not at all: workers starting together may race here
    except OSError:
        pass
    return tk


# Part of the cache key: change it when _gemma_sentencepiece or _with_file_tokens changes.
_BUILDER_VERSION = "gemma-sentencepiece/1"


def _gemma_sentencepiece(tokens: list[str], unk: str | None) -> tuple[Tokenizer, dict[str, int]]:
    """Gemma's SentencePiece BPE from a GGUF vocabulary, as transformers builds it
    (``GemmaTokenizer``: spaces normalised to ``▁``, byte fallback, no prefix space).

    The file has no merges: they are rebuilt from the vocabulary, every split of a token into two
    tokens, ranked by the token's place in the file (Gemma's scores do not follow its merge
    order; the order of the vocabulary does). A token of spaces only is stored with real spaces
    and looked up as ``▁``s. Returns the tokenizer and the vocabulary as spelled for it.
    """
    spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}  # a spelling twice: the later id, as transformers has it
    merges = []
    for token, rank in vocab.items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((rank, len(left), len(right), left, right) for left, right in pairs)
    merges.sort(key=lambda m: (m[0], -m[1], -m[2]))  # best first: earlier token, then longer left, longer right
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(left, right) for *_, left, right in merges], fuse_unk=True,
                              unk_token=unk, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "▁")
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tk, vocab


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _compile_template(source: str) -> jinja2.Template:
    """A chat template in the sandboxed environment Hugging Face renders them with."""

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Text from tokens as they come; a character split across tokens waits for its last byte."""

    def __init__(self, tokenizer: ModelTokenizer, skip_special_tokens: bool = True, prefix_ids: list[int] = ()):
        """``prefix_ids``: tokens whose text was already reported (a continuation starts after them)."""
        self._tokenizer = tokenizer.tokenizer
        self._stream = DecodeStream(ids=list(prefix_ids) or None, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""


def load_tokenizer(spec: str) -> ModelTokenizer:
    """The tokenizer of a model spec, without loading its weights (random models: the default's)."""
    from pdserve.engine.config import DEFAULT_MODEL
    from pdserve.engine.gguf_file import GGUFFile
    from pdserve.engine.sources import resolve_model

    source = resolve_model(spec)
    if source.kind == "random":
        source = resolve_model(DEFAULT_MODEL)
    if source.kind == "gguf":
        return ModelTokenizer.from_gguf_fields(GGUFFile(source.path).fields)
    return ModelTokenizer.from_hf_dir(source.path, _generation_eos(source.path))



def _generation_eos(path: Path) -> list[int]:
    for name, key in (("generation_config.json", "eos_token_id"), ("config.json", "eos_token_id")):
        file = path / name
        if file.exists() and (value := json.loads(file.read_text()).get(key)) is not None:
            return [value] if isinstance(value, int) else list(value)
    return []
