"""Structured outputs in the engine: what a constrained request produces always parses and validates, in batches
mixed with free requests that stay token-exact, after a resume too; constraints that do not compile are refused."""

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidRequest
from services.common.sampling import Guided, SamplingParams
from tests.support.reference import greedy, hf_greedy, make_engine, random_prompts

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
LEAVES = st.one_of(
    st.integers(0, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.one_of(st.text(max_size=6), st.integers(-9, 9), st.booleans()), min_size=1, max_size=4,
             unique_by=lambda v: (type(v), v)).map(lambda vs: {"enum": vs}),
    st.sampled_from(["^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$"]).map(
        lambda p: {"type": "string", "pattern": p}),
    st.text(max_size=6).map(lambda v: {"const": v}),
)


def _objects(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(lambda props: st.builds(
        lambda required: {"type": "object", "properties": props, "required": sorted(required),
                          "additionalProperties": False},
        st.sets(st.sampled_from(sorted(props)))))


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        _objects(children),
        st.tuples(children, st.integers(0, 3), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": min(t[1], 1), "maxItems": t[1] + t[2]}),
        st.lists(children, min_size=2, max_size=2).map(lambda two: {"anyOf": two}),
    ),
    max_leaves=6,
)


def _run(engine, reqs: dict) -> dict:
    """reqs: id -> (prompt ids, params); returns id -> (output ids, finish reason)."""
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.req_id] = (o.request.output_token_ids, o.finish_reason)
    return done


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make_engine(tiny_model, num_blocks=1024, budget=256)


@settings(max_examples=8)
@given(st.lists(SCHEMAS, min_size=8, max_size=8))
def test_json_schema_outputs_parse_and_validate(engine, schemas):
    """8 batches of 8 generated schemas (64 in all), sampled at temperature 1 in one batch each: every output
    ends by its grammar ("stop") and validates against its schema."""
    prompts = random_prompts(len(schemas), seed=len(json.dumps(schemas)), lo=3, hi=20, vocab=4000)
    reqs = {f"s{i}": (p, SamplingParams(max_tokens=700, temperature=1.0, seed=i,
                                        guided=Guided("json", json.dumps(schema))))
            for i, (p, schema) in enumerate(zip(prompts, schemas))}
    done = _run(engine, reqs)
    for i, schema in enumerate(schemas):
        tokens, reason = done[f"s{i}"]
        text = engine.tokenizer.decode(tokens)
        assert reason == "stop", f"schema {schema}: ended by {reason} after {len(tokens)} tokens: {text!r}"
        jsonschema.validate(json.loads(text), schema)
    assert engine.load().blocks_used == 0


def test_regex_choice_and_grammars_hold(engine):
    kinds = {
        "regex": (Guided("regex", r"[a-z]{3}-\d{2,4}"), lambda t: re.fullmatch(r"[a-z]{3}-\d{2,4}", t)),
        "choice": (Guided("choice", json.dumps(["yes", "no", "maybe \"so\""])), lambda t: t in ("yes", "no",
                                                                                             'maybe "so"')),
        "lark": (Guided("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
                 lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", t)),
        "gbnf": (Guided("grammar", 'root ::= "[" item "]"\nitem ::= [a-c]+'), lambda t: re.fullmatch(r"\[[a-c]+\]", t)),
    }
    reqs = {f"{name}{seed}": ([5, 6, 7 + seed], SamplingParams(max_tokens=400, temperature=1.0, seed=seed,
                                                                guided=guided))
            for name, (guided, _) in kinds.items() for seed in range(4)}
    done = _run(engine, reqs)
    for rid, (tokens, reason) in done.items():
        text = engine.tokenizer.decode(tokens)
        assert reason == "stop" and kinds[rid[:-1]][1](text), f"{rid}: {reason} {text!r}"


def test_json_object_outputs_are_objects(engine):
    """Any JSON object: its keys and strings are unbounded, so a random model may run out of tokens inside one
    (cut at "length", as OpenAI's server does); every output that ended is an object, and every output starts one."""
    reqs = {f"o{seed}": ([5, 6, 7 + seed], SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                         guided=Guided("json_object"))) for seed in range(8)}
    done = _run(engine, reqs)
    for tokens, reason in done.values():
        text = engine.tokenizer.decode(tokens)
        assert text.lstrip().startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert reason == "length"


def test_free_greedy_requests_are_token_exact_beside_constrained_ones(tiny_model, engine):
    """Greedy output of unconstrained requests is the same (and transformers') when constrained requests share
    every step of their batch."""
    prompts = random_prompts(4, seed=3, lo=5, hi=40, vocab=4000)
    refs = hf_greedy(tiny_model, prompts, 24)
    reqs = {f"free{i}": (p, greedy(24)) for i, p in enumerate(prompts)}
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    reqs.update({f"json{i}": (p, SamplingParams(max_tokens=24, temperature=0.0, guided=Guided("json", schema)))
                 for i, p in enumerate(prompts)})
    done = _run(engine, reqs)
    for i, ref in enumerate(refs):
        assert done[f"free{i}"][0] == ref.tokens
        assert done[f"json{i}"][0] != ref.tokens  # the constraint did change its neighbours' output


def test_a_resumed_constrained_request_continues_its_grammar(engine):
    """A resume (the prompt ends with outputs already streamed) feeds them to the grammar first: the output goes on
    exactly as the uninterrupted one (same seed), and a resume whose streamed outputs break the grammar ends."""
    guided = Guided("json", json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                   "maximum": 99}, "minItems": 3, "maxItems": 6}))
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=42, guided=guided)
    prompt = [9, 10, 11, 12]
    whole, reason = _run(engine, {"whole": (prompt, params)})["whole"]
    assert reason == "stop" and len(whole) > 4
    engine.add_request("resumed", prompt + whole[:3], params, resumed_outputs=3)
    done = {}
    while engine.has_unfinished():
        done.update({o.req_id: o for o in engine.step() if o.finished})
    assert done["resumed"].request.output_token_ids == whole[3:]
    bad = engine.tokenizer.encode("}}", add_special_tokens=False)
    engine.add_request("broken", prompt + bad, params, resumed_outputs=len(bad))
    while engine.has_unfinished():
        done.update({o.req_id: o for o in engine.step() if o.finished})
    assert done["broken"].finish_reason == "abort"
    assert engine.load().blocks_used == 0


BAD = [
    (Guided("regex", "a["), "does not compile"),
    (Guided("json", '{"type": "frobnicate"}'), "frobnicate"),
    (Guided("json", "{not json"), "not valid JSON"),
    (Guided("json", "[1, 2]"), "JSON object"),
    (Guided("choice", "[]"), "non-empty list"),
    (Guided("choice", '["a", 3]'), "non-empty list"),
    (Guided("grammar", "start: undefined_rule"), "does not compile"),
    (Guided("xml", "<a/>"), "must be one of"),
    (Guided("regex", ""), "empty"),
    (Guided("json_object", "{}"), "takes no spec"),
    (Guided("regex", "a" * (256 * 1024 + 1)), "over"),
]


@pytest.mark.parametrize("guided,fragment", BAD, ids=[f"{g.kind}:{g.spec[:20]}" for g, _ in BAD])
def test_a_constraint_that_does_not_compile_is_refused(engine, guided, fragment):
    with pytest.raises(InvalidRequest, match=re.escape(fragment)):
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, guided=guided))
    assert not engine.has_unfinished() and engine.load().blocks_used == 0
