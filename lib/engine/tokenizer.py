"""Tokenizers that travel with checkpoints (``CKPT/hf/``): loading, fingerprints, prompt encoding."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import tempfile

import fsspec

from llamarl.lib.errors import UserError
from llamarl.lib.files.checksums import is_local


@functools.cache
def _local_dir(url: str) -> str:
    """``url`` itself when local, else a local copy (transformers reads local files only)."""
    fs, path = fsspec.core.url_to_fs(url)
    if is_local(fs):
        return path
    local = tempfile.mkdtemp(prefix="llamarl-tok-")
    fs.get(fs.ls(path, detail=False), f"{local}/")
    return local


# tokenizer_config.json's classes that are transformers' generic fast tokenizer itself (Llama 3's,
# and what save_pretrained of one writes): loaded as that class, without AutoTokenizer's imports of
# every model's configuration (a third of the tokenizer's load).
_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load(checkpoint: str):
    """The tokenizer stored with a published checkpoint (its ``hf/`` folder): what
    ``AutoTokenizer`` loads from it."""
    hf_dir = f"{checkpoint.rstrip('/')}/hf"
    local = _local_dir(hf_dir)
    if not any(n.startswith("tokenizer") for n in os.listdir(local)):
        raise UserError(f"{hf_dir} has no tokenizer files; shard an HF checkpoint that includes its tokenizer")
    try:
        with open(os.path.join(local, "tokenizer_config.json")) as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in _GENERIC_FAST and os.path.exists(os.path.join(local, "tokenizer.json")):
        import transformers

        return getattr(transformers, cls).from_pretrained(local)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local)


def fingerprint(tok) -> str:
    """A hash of what the tokenizer does (vocabulary, merges, normalisation, special tokens), not
    of its name: two tokenizers with the same fingerprint turn text into the same ids."""
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    special = json.dumps(tok.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((body + special).encode()).hexdigest()[:16]


def stop_token_ids(checkpoint: str, tok) -> list[int]:
    """EOS ids from the checkpoint's generation config (or config), else the tokenizer's."""
    fs, path = fsspec.core.url_to_fs(f"{checkpoint.rstrip('/')}/hf")
    for name in ("generation_config.json", "config.json"):
        if fs.exists(f"{path}/{name}"):
            eos = json.loads(fs.cat_file(f"{path}/{name}")).get("eos_token_id")
            if eos is not None:
                return sorted(set(eos if isinstance(eos, list) else [eos]))
    return [tok.eos_token_id] if tok.eos_token_id is not None else []


def encode_prompt(tok, prompt, chat_template: str = "auto") -> list[int]:
    """Token ids for a prompt given as text or as chat messages ``[{role, content}, ...]``.

    ``chat_template``: ``auto`` applies the tokenizer's template when it has one (text becomes one
    user message); ``never`` encodes text as is; ``always`` requires a template."""
    is_chat = isinstance(prompt, list)
    has_template = bool(getattr(tok, "chat_template", None))
    if chat_template not in ("auto", "never", "always"):
        raise UserError(f"chat_template={chat_template!r}: use auto, never or always")
    if (is_chat or chat_template == "always") and not has_template:
        raise UserError("the prompts are chat messages but the tokenizer has no chat template; give text prompts "
                        "or a tokenizer with a template")
    if is_chat or (has_template and chat_template != "never"):
        from jinja2 import TemplateError  # what a template raises (raise_exception), as transformers renders it

        messages = prompt if is_chat else [{"role": "user", "content": prompt}]
        # Rendered, then encoded without extra specials: the template already has what it wants.
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:
            said = (str(e).splitlines() or [type(e).__name__])[0]
            raise UserError(f"the tokenizer's chat template refuses these messages ({said}); give it messages it "
                            "takes (their roles, their order)") from None
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(prompt, add_special_tokens=True)["input_ids"]


def render_prompt(prompt) -> str:
    """The prompt as stored in outputs: text as is, chat messages as JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


class Local:
    """A tokenizer in this process behind the batch interface the rollout stage uses (the same as
    ``tokenizer_process.TokenizerProcess``'s): prompts to ids, responses to text."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_token_id = tok.eos_token_id

    def encode_prompts(self, prompts: list, chat_template: str = "auto") -> list[list[int]]:
        return [encode_prompt(self.tok, p, chat_template) for p in prompts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [self.tok.decode(x, skip_special_tokens=True) for x in ids]

    def for_thread(self) -> "Local":
        return Local(copy.deepcopy(self.tok))  # a tokenizer object is not to be shared across threads
