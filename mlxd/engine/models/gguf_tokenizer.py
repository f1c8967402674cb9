"""Build Hugging Face tokenizer files from a GGUF file's vocabulary (no transformers, no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from mlxd.engine.models.gguf import GGUFError, GGUFFile

# llama.cpp token types (llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Pre-tokenizer regexes as llama.cpp's llm_tokenizer_bpe table (src/llama-vocab.cpp) has them.
# llama.cpp applies them in order, each to the pieces the previous one produced, keeping the
# unmatched stretches as pieces too: a Sequence of "isolated" Splits does the same.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS_RE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (
    _CONTRACTIONS_RE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    _CONTRACTIONS_RE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How one `tokenizer.ggml.pre` value splits text, and llama.cpp's flags for it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    clean_spaces: bool = True


_DEFAULT = PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2 = PreTokenizerSpec((_GPT2_RE,))
_SMOLLM = PreTokenizerSpec((r"\p{N}", _GPT2_RE), clean_spaces=False)
_LLAMA3 = PreTokenizerSpec((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizerSpec((_QWEN2_RE,), clean_spaces=False)

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "smollm": _SMOLLM,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
}


@dataclass(frozen=True)
class Vocab:
    """The GGUF vocabulary fields the converters use."""

    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[str]

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Vocab:
        """Read the vocabulary arrays; types default to NORMAL and scores to 0."""
        tokens = [str(t) for t in gguf.require("tokenizer.ggml.tokens")]
        types = list(gguf.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        scores = list(gguf.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        if len(types) != len(tokens) or len(scores) != len(tokens):
            raise GGUFError(f"{gguf.path}: tokenizer arrays have different lengths")
        return cls(tokens, types, scores, list(gguf.get("tokenizer.ggml.merges") or []))

    def is_added(self, token_id: int) -> bool:
        """Whether the token is matched whole in text (CONTROL and USER_DEFINED tokens)."""
        return self.token_types[token_id] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)

    def added_tokens(self) -> list[dict[str, Any]]:
        """tokenizer.json `added_tokens`: CONTROL tokens are special, USER_DEFINED are not."""
        return [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": self.token_types[i] == TOKEN_CONTROL,
            }
            for i, tok in enumerate(self.tokens)
            if self.is_added(i)
        ]

    def vocab_dict(self) -> dict[str, int]:
        """token -> id; a duplicated token keeps its first id (ids stay dense for the model)."""
        vocab: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            vocab.setdefault(tok, i)
        return vocab


def _pre_tokenizer_spec(gguf: GGUFFile) -> PreTokenizerSpec:
    pre = str(gguf.get("tokenizer.ggml.pre", "default"))
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise GGUFError(
            f"{gguf.path}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r} "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return spec


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _byte_level_json(gguf: GGUFFile, vocab: Vocab) -> dict[str, Any]:
    """tokenizer.json for a `gpt2` (byte-level BPE) vocabulary."""
    spec = _pre_tokenizer_spec(gguf)
    if not vocab.merges:
        raise GGUFError(f"{gguf.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": spec.ignore_merges,
        "vocab": vocab.vocab_dict(),
        "merges": [m.split(" ", 1) for m in vocab.merges],
    }
    pre = [_split(r) for r in spec.regexes] + [byte_level]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": vocab.added_tokens(),
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre},
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": model,
    }


def _spm_merges(vocab: Vocab) -> list[list[str]]:
    """BPE merges that replay SentencePiece's greedy highest-score-first merging."""
    ids = vocab.vocab_dict()
    ranked: list[tuple[float, int, int, str, str]] = []
    for tok, tok_id in ids.items():
        if vocab.token_types[tok_id] != TOKEN_NORMAL:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[tok_id], ids[left], ids[right], left, right))
    ranked.sort()
    return [[left, right] for _, _, _, left, right in ranked]


def _spm_json(gguf: GGUFFile, vocab: Vocab) -> dict[str, Any]:
    """tokenizer.json for a `llama` (SentencePiece BPE with byte fallback) vocabulary."""
    if TOKEN_BYTE not in vocab.token_types:
        raise GGUFError(f"{gguf.path}: a llama (SentencePiece) vocabulary without byte tokens")
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    add_prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    normalizers: list[dict[str, Any]] = [{"type": "Prepend", "prepend": "▁"}] if add_prefix else []
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": vocab.tokens[unk_id] if unk_id is not None else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": vocab.vocab_dict(),
        "merges": _spm_merges(vocab),
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": vocab.added_tokens(),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }


@dataclass(frozen=True)
class SpecialTokens:
    """The special token strings and flags tokenizer_config.json needs."""

    bos: str | None
    eos: str | None
    unk: str | None
    pad: str | None
    add_bos: bool
    add_eos: bool
    clean_spaces: bool


def _token_at(gguf: GGUFFile, vocab: Vocab, key: str) -> str | None:
    token_id = gguf.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(vocab.tokens):
        return None
    return vocab.tokens[int(token_id)]


def special_tokens(gguf: GGUFFile, vocab: Vocab) -> SpecialTokens:
    """bos/eos/unk/pad strings and add_bos/add_eos, defaulting the way llama.cpp does."""
    is_spm = gguf.get("tokenizer.ggml.model") == "llama"
    default_bos = True if is_spm else _pre_tokenizer_spec(gguf).add_bos
    clean = False if is_spm else _pre_tokenizer_spec(gguf).clean_spaces
    return SpecialTokens(
        bos=_token_at(gguf, vocab, "bos"),
        eos=_token_at(gguf, vocab, "eos"),
        unk=_token_at(gguf, vocab, "unknown"),
        pad=_token_at(gguf, vocab, "padding"),
        add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", default_bos)),
        add_eos=bool(gguf.get("tokenizer.ggml.add_eos_token", False)),
        clean_spaces=clean,
    )


def _post_processor(specials: SpecialTokens, ids: dict[str, int]) -> dict[str, Any] | None:
    """A TemplateProcessing that adds BOS/EOS the way the GGUF asks, or None."""
    bos = specials.bos if specials.add_bos else None
    eos = specials.eos if specials.add_eos else None
    if bos is None and eos is None:
        return None
    pre = [{"SpecialToken": {"id": bos, "type_id": 0}}] if bos else []
    post = [{"SpecialToken": {"id": eos, "type_id": 0}}] if eos else []
    single = [*pre, {"Sequence": {"id": "A", "type_id": 0}}, *post]
    pair = [*single, *pre, {"Sequence": {"id": "B", "type_id": 1}}, *post]
    used = [t for t in (bos, eos) if t]
    special = {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in used}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}


def tokenizer_json(gguf: GGUFFile, vocab: Vocab | None = None) -> dict[str, Any]:
    """The tokenizer.json document for the GGUF's vocabulary; GGUFError if unsupported."""
    vocab = vocab or Vocab.from_gguf(gguf)
    model = gguf.get("tokenizer.ggml.model")
    if model == "gpt2":
        doc = _byte_level_json(gguf, vocab)
    elif model == "llama":
        doc = _spm_json(gguf, vocab)
    else:
        raise GGUFError(
            f"{gguf.path}: unsupported tokenizer model tokenizer.ggml.model={model!r} "
            "(supported: gpt2, llama)"
        )
    doc["post_processor"] = _post_processor(special_tokens(gguf, vocab), vocab.vocab_dict())
    return doc


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's (llama.cpp's) tokenizer."""
    return Tokenizer.from_str(json.dumps(tokenizer_json(gguf)))


def eos_token_ids(gguf: GGUFFile) -> list[int]:
    """The ids that end generation: EOS, then EOT and EOM when the GGUF names them."""
    keys = ("eos", "eot", "eom")
    found = [gguf.get(f"tokenizer.ggml.{k}_token_id") for k in keys]
    return list(dict.fromkeys(int(i) for i in found if i is not None))


def _tokenizer_config(gguf: GGUFFile, specials: SpecialTokens) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials.bos,
        "eos_token": specials.eos,
        "unk_token": specials.unk,
        "pad_token": specials.pad,
        "add_bos_token": specials.add_bos,
        "add_eos_token": specials.add_eos,
        "clean_up_tokenization_spaces": specials.clean_spaces,
        "model_max_length": int(gguf.arch_value("context_length", 2048)),
    }
    if template := gguf.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def write_tokenizer_files(gguf: GGUFFile, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json."""
    vocab = Vocab.from_gguf(gguf)
    doc = tokenizer_json(gguf, vocab)
    Tokenizer.from_str(json.dumps(doc))  # fail here, not at load time, on a bad document
    (out_dir / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    specials = special_tokens(gguf, vocab)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(gguf, specials))
    names = {
        "bos_token": specials.bos,
        "eos_token": specials.eos,
        "unk_token": specials.unk,
        "pad_token": specials.pad,
    }
    _write_json(out_dir / "special_tokens_map.json", {k: v for k, v in names.items() if v})
    generation: dict[str, Any] = {"eos_token_id": eos_token_ids(gguf)}
    if (bos_id := gguf.get("tokenizer.ggml.bos_token_id")) is not None:
        generation["bos_token_id"] = int(bos_id)
    _write_json(out_dir / "generation_config.json", generation)
