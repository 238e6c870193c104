"""Resolve a model name or path to a Hugging Face directory, converting GGUF once.

A model argument is one of:
  * an embedded name (`smollm2-135m-instruct`, `gemma-3-270m`),
  * a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files),
  * a `.gguf` file.
GGUF files are dequantized once (transformers' GGUF reader, built on the `gguf`
package) to float32 safetensors + tokenizer files under the cache directory
(`$PDSERVE_CACHE_DIR/models`, default `~/.cache/pdserve/models`). Later starts read
that directory in seconds and cast to the serving dtype at load. float32 is the
cache dtype because the dequantized Q4 values are exact in it: bf16 serving and
fp32 parity tests read the same file.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from cluster import settings
from engine.embedded import EMBEDDED, gguf_path

CACHE_FORMAT = 1  # bump when the conversion's output changes


def cache_root() -> Path:
    """$PDSERVE_CACHE_DIR, else ~/.cache/pdserve (cluster/settings.py)."""
    return settings.cache_dir()


def _gguf_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}:{CACHE_FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def _convert_gguf(gguf: Path, out_dir: Path, eos_ids: tuple[int, ...] | None) -> None:
    """Dequantize `gguf` into an HF directory at `out_dir` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"[pdserve] converting {gguf.name} to safetensors (once) -> {out_dir}", file=sys.stderr)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp", dir=out_dir.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.hf_quantizer = None  # else save_pretrained refuses a "quantized" model
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if eos_ids:
            model.generation_config.eos_token_id = list(eos_ids)
        model.save_pretrained(str(tmp))
        del model
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(tmp))
        (tmp / "pdserve_source.json").write_text(json.dumps({"gguf": str(gguf), "format": CACHE_FORMAT}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def cached_model_dir(name_or_path: str) -> Path:
    """Return an HF checkpoint directory for `name_or_path`, converting GGUF on first use.

    Raises FileNotFoundError naming what is missing.
    """
    if name_or_path in EMBEDDED:
        out = cache_root() / "models" / name_or_path
        if not (out / "config.json").exists():
            _convert_gguf(gguf_path(name_or_path), out, EMBEDDED[name_or_path].eos_token_ids)
        return out
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        out = cache_root() / "models" / f"{path.stem}-{_gguf_key(path)}"
        if not (out / "config.json").exists():
            _convert_gguf(path, out, None)
        return out
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json; not a Hugging Face checkpoint directory")
        if not list(path.glob("*.safetensors")) and not list(path.glob("*.bin")):
            raise FileNotFoundError(f"{path} has no *.safetensors weights")
        return path
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither an embedded name ({', '.join(EMBEDDED)}), "
        "a checkpoint directory, nor a .gguf file"
    )


def served_name(name_or_path: str) -> str:
    """Short id to serve a model under (`/v1/models`)."""
    if name_or_path in EMBEDDED:
        return name_or_path
    p = Path(name_or_path)
    return p.stem if p.suffix == ".gguf" else p.name


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Prepare models: convert GGUF to the cache once.")
    ap.add_argument("models", nargs="*", default=list(EMBEDDED), help="names or paths (default: all embedded)")
    for name in ap.parse_args().models:
        print(f"{name}: {cached_model_dir(name)}")


if __name__ == "__main__":
    main()
