"""Grammar-constrained decoding in the engine (engine/grammar.py), on the embedded SmolLM2."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.grammar import GrammarError, GrammarSpec, mask_logits, schema_ebnf, to_grammar
from engine.llm_engine import LLMEngine
from engine.sampler import Sampler, SamplingBatch
from engine.sampling_params import SamplingParams

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype="float32", kv_cache_gb=0.2, max_num_seqs=16))
    yield eng
    eng.close()


def _prompt(eng, text: str) -> list[int]:
    tok = eng.tokenizer
    return tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False).input_ids


def _run(eng, prompts, params):
    return eng.generate(prompts, params)


def test_spec_validation():
    with pytest.raises(GrammarError, match="kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(GrammarError, match="needs its text"):
        GrammarSpec("regex", "")
    assert GrammarSpec.coerce(("regex", "a+")) == GrammarSpec("regex", "a+")
    assert SamplingParams(grammar=("json_object", "")).grammar == GrammarSpec("json_object")
    with pytest.raises(GrammarError, match="Unsupported type"):
        to_grammar(GrammarSpec("json_schema", '{"type": "objectx"}'))
    with pytest.raises(GrammarError, match="invalid ebnf"):
        to_grammar(GrammarSpec("ebnf", "root ::= ("))
    ebnf = schema_ebnf({"type": "integer"}, "args")
    assert "args ::=" in ebnf and "root" not in ebnf


def test_exactly_one_string(engine):
    """A grammar that allows one string produces it, then ends (stop), greedy or sampled."""
    want = "The answer is 42."
    spec = GrammarSpec("ebnf", f'root ::= "{want}"')
    prompts = [_prompt(engine, "Say something about dogs.")] * 2
    params = [SamplingParams(max_tokens=40, temperature=0, grammar=spec),
              SamplingParams(max_tokens=40, temperature=1.5, seed=3, grammar=spec)]
    for o in _run(engine, prompts, params):
        assert o.text == want and o.finish_reason == "stop"
    assert engine.pool.used_pages == 0


def test_json_schema_output_validates_in_a_mixed_batch(engine):
    """Constrained rows give JSON that validates; the unconstrained row in the same batch gives
    what it gives alone (free rows pay nothing and see no mask)."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    p_json = _prompt(engine, "Plan a trip. Answer in JSON with city and days.")
    p_free = _prompt(engine, "Write a haiku about the sea.")
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = _run(engine, [p_free], free)[0]
    outs = _run(engine, [p_json, p_free, p_json],
                [SamplingParams(max_tokens=60, temperature=0, grammar=spec), free,
                 SamplingParams(max_tokens=60, temperature=0.8, top_p=0.9, seed=11, grammar=spec, logprobs=2)])
    assert outs[1].new_token_ids == alone.new_token_ids
    for o in (outs[0], outs[2]):
        assert o.finish_reason == "stop", o.text
        obj = json.loads(o.text)
        assert set(obj) == {"city", "days"} and 1 <= obj["days"] <= 9 and len(obj["city"]) <= 20
    lp = outs[2].logprobs
    assert lp and all(t.logprob > -9999 for t in lp)  # the chosen tokens were allowed
    assert json.loads(_run(engine, [p_json], SamplingParams(max_tokens=60, temperature=0,
                                                            grammar=GrammarSpec("json_object")))[0].text) is not None


def test_resumed_matcher_continues_the_same_output(engine):
    """A request resumed from its first token (as a PD decode rank does) ends as the
    uninterrupted one: the matcher is rebuilt from the spec and the tokens so far."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompt = _prompt(engine, "Plan a trip to Rome. JSON please.")
    params = SamplingParams(max_tokens=60, temperature=0, grammar=spec)
    whole = _run(engine, [prompt], params)[0]
    engine.add_request("pre", prompt, params, prefill_only=True)
    first = None
    while engine.has_unfinished():
        for o in engine.step():
            first = o
    assert first.new_token_ids == whole.new_token_ids[:1]
    engine.add_imported("rest", prompt, first.new_token_ids, params, first.kv_export)
    toks = list(first.new_token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            toks += o.new_token_ids
    assert toks == whole.new_token_ids
    with pytest.raises(ValueError, match="does not follow"):
        engine.add_imported("bad", prompt, [engine.tokenizer.encode("x")[0]], params, first.kv_export)


def test_mask_against_torch_reference():
    """mask_logits sets exactly the forbidden tokens to -inf (a bool-mask reference), only on
    the constrained rows; sampling then never picks a forbidden token."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from engine.model_cache import cached_model_dir

    tok = AutoTokenizer.from_pretrained(str(cached_model_dir("smollm2-135m-instruct")))
    from engine.grammar import GrammarCompiler

    comp = GrammarCompiler(lambda: tok, 49152, [2])
    m = comp.matcher(GrammarSpec("regex", "[0-9]{3}"))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 49152, generator=g)
    ref = logits.clone()
    mask_logits(logits, [None, m, None])
    bitmask = xgr.allocate_token_bitmask(1, 49152)
    m.fill_next_token_bitmask(bitmask, 0)
    allowed = xgr.testing.bitmask_to_bool_mask(bitmask)[0][:49152]
    assert torch.equal(logits[0], ref[0]) and torch.equal(logits[2], ref[2])
    assert torch.equal(logits[1][allowed], ref[1][allowed])
    assert bool((logits[1][~allowed] == float("-inf")).all()) and 0 < int(allowed.sum()) < 49152
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    for _ in range(20):
        batch = SamplingBatch.build(params, [[1]] * 3, [[]] * 3, 49152, torch.device("cpu"))
        assert bool(allowed[Sampler()(logits, batch).token_ids[1]])
