"""Per-request sampling parameters, validated once at admission."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.grammar import GrammarSpec


MAX_CACHE_SALT = 1024  # characters of a cache_salt
MAX_LOGIT_BIAS = 1024  # tokens a logit_bias names (OpenAI takes 300)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and of the stop checker.

    temperature == 0 means greedy (argmax; top_p/top_k/min_p are then ignored).
    top_k <= 0 means no top-k cut; top_p == 1 and min_p == 0 disable theirs.
    repetition_penalty applies to prompt and output tokens (HF/vLLM semantics:
    positive logits divided, negative multiplied); presence/frequency penalties
    apply to output tokens only (OpenAI semantics).
    seed: same seed and same inputs give the same tokens, whatever else is batched.
    logprobs: None for none, else the number of top alternatives (0..20) returned
    beside the chosen token's own logprob.
    prompt_logprobs: None for none, else the same for every prompt token after the first (the
    model's raw log-softmax given the tokens before it; vLLM's prompt_logprobs, what completions'
    echo + logprobs reports). A request asking for them computes its whole prompt (no prefix-cache
    hit: a cached page has no logits) and gets them with its first token.
    grammar: a GrammarSpec (or its wire form, a (kind, text) pair) the output must follow
    (engine/grammar.py); None for free text. Under a grammar the grammar decides where the
    output may end (min_tokens does not hold its end-of-sequence back, and ignore_eos does not
    carry it past a complete grammar).
    Raises ValueError naming the field on any invalid value.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    # Per-request switch for the host prefix cache (issue: hicache).
    prefix_cache: bool = True
    # The tenant's salt (vLLM's and SGLang's cache_salt): folded into the page keys, so a prompt is a
    # prefix-cache hit only for requests of the same salt (hicache.index.salted_root). "": none.
    cache_salt: str = ""
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits first of all.
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    grammar: GrammarSpec | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "grammar", GrammarSpec.coerce(self.grammar))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {v!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):  # (also NaN)
            raise ValueError("logit_bias values must be in [-100, 100]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters")

    def token_ids(self) -> dict[str, tuple[int, ...]]:
        """Every token id this request carries outside its prompt, by field (the fields the
        sampler uses as indices into the logits). Admission checks them against the vocabulary:
        an id out of range is the request's error, never its step's."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": tuple(t for t, _ in self.logit_bias)}

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming the field and the first id outside [0, vocab_size)."""
        for name, ids in self.token_ids().items():
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"{name}: token id {t} is outside this model's vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
