"""What the engine hands out: a request's step outputs and the KV that travels between ranks."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv_cache import SwaState


@dataclass
class KVExport:
    """A prompt's KV as the prefill side computed it: everything a decode side needs to continue.

    pages: [num_pages, num_full_layers, 2, page_size, kvh, hd] covering positions [0, num_tokens).
    """

    num_tokens: int
    pages: torch.Tensor
    swa: SwaState | None


@dataclass
class KVReservation:
    """Device pages and an SWA slot taken for a prompt whose KV arrives by transfer.

    pages cover positions [0, num_tokens) once filled; swa_slot is None for models without
    sliding layers. Hand it to add_prefilled() (which takes ownership) or release_kv().
    """

    num_tokens: int
    pages: list[int]
    swa_slot: int | None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PromptLogprobs:
    """Log-probabilities of a prompt's tokens 1 .. n-1 (token 0 has none): entry j is token j+1
    under the model given tokens 0 .. j (raw log-softmax, before any sampling setting), its rank
    in the vocabulary (1: the most likely) and the `k` most likely tokens there."""

    k: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    @classmethod
    def empty(cls, prompt_len: int, k: int) -> PromptLogprobs:
        n = max(0, prompt_len - 1)
        return cls(k, [0.0] * n, [0] * n, [[] for _ in range(n)], [[] for _ in range(n)])


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the last output
    finished: bool
    finish_reason: str | None = None
    stop_str: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_export: KVExport | None = field(default=None, repr=False)
    prompt_logprobs: PromptLogprobs | None = field(default=None, repr=False)  # with the first token
