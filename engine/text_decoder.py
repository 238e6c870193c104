"""The tokenizer's decode for an engine's detokenizer, without importing transformers.

An engine needs one thing of the tokenizer: decode(ids, skip_special_tokens) with clean-up off
(engine/detokenizer.py). transformers' fast tokenizers (TokenizersBackend, and the subclasses
that keep its decode: the embedded models' and most checkpoints') answer that from their
`tokenizers` backend alone: `backend.decode(ids, skip_special_tokens=...)`. Loading one through
AutoTokenizer imports transformers' model machinery (torch.distributed, sympy): 5-6 s of CPU of
each rank's start-up on this 2-core VM. The backend's state loads in ~0.1 s without it.

So a process that loads the tokenizer through transformers (`remember`: a rank the first time,
the launcher before its ranks start) saves its backend's state under the cache directory
(`$PDSERVE_CACHE_DIR/tokenizers/<key>.json`, written under a temporary name and renamed), and
`load_decoder` reads that file where it exists. The key hashes what AutoTokenizer's result
depends on: the name and bytes of every file of the model directory but its weights, and the
transformers and tokenizers versions. Another checkpoint, an edited tokenizer file or an upgrade
finds no file, so the tokenizer loads through transformers (and the file is saved for the next
start). A tokenizer whose decode is not its backend's is never saved: it always loads through
transformers, and serves decode itself.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import threading
from pathlib import Path

from engine.model_cache import cache_root

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what is saved, or how it is decoded, changes
# Files of a model directory that no tokenizer reads (the key skips them: hashing them is slow).
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


class BackendDecoder:
    """decode() exactly as transformers' TokenizersBackend gives it, from its backend's state."""

    def __init__(self, backend) -> None:
        self.backend = backend  # a tokenizers.Tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        """Raises ValueError for clean-up (transformers' own pass; the detokenizer never asks it)."""
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is transformers' pass; load the tokenizer through it")
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def state_path(model_dir: str | Path) -> Path | None:
    """Where the backend state of `model_dir`'s tokenizer is saved; None where the directory cannot
    be read."""
    try:
        digest = hashlib.blake2b(digest_size=12)
        for part in (str(FORMAT), importlib.metadata.version("transformers"),
                     importlib.metadata.version("tokenizers")):
            digest.update(part.encode() + b"\0")
        for f in sorted(Path(model_dir).iterdir()):
            if f.is_file() and not f.name.endswith(_WEIGHTS):
                digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    return cache_root() / "tokenizers" / f"{digest.hexdigest()}.json"


def decodes_with_backend(tokenizer) -> bool:
    """Whether `tokenizer`'s decode (clean-up off) is its backend's decode, so a BackendDecoder over
    the backend's state gives the same text."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and cls.decode is TokenizersBackend.decode
            and cls._decode is TokenizersBackend._decode)


def remember(tokenizer, model_dir: str | Path) -> None:
    """Save `tokenizer`'s backend state for load_decoder (where decodes_with_backend and it is not
    saved yet). Best effort: a cache that cannot be written is logged and skipped."""
    path = state_path(model_dir)
    if path is None or path.exists() or not decodes_with_backend(tokenizer):
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(tokenizer.backend_tokenizer.to_str())
        os.replace(tmp, path)  # readers see the whole file or none
    except OSError as e:
        log.warning("tokenizer: cannot save its state to %s (%s)", path, e)
        tmp.unlink(missing_ok=True)


def load_decoder(model_dir: str | Path):
    """An object with the tokenizer's decode(ids, skip_special_tokens, clean_up_tokenization_spaces=False):
    a BackendDecoder where the state is saved, else the tokenizer loaded through transformers
    (whose state is then saved)."""
    path = state_path(model_dir)
    if path is not None and path.exists():
        from tokenizers import Tokenizer

        try:
            return BackendDecoder(Tokenizer.from_file(str(path)))
        except Exception as e:  # a damaged file: load through transformers, which saves it anew
            log.warning("tokenizer: cannot read its saved state %s (%s); loading it through transformers", path, e)
            path.unlink(missing_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    remember(tokenizer, model_dir)
    return tokenizer
