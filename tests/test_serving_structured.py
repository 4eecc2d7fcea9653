"""Structured outputs through the OpenAI-compatible server: OpenAI's ``response_format``
(``json_schema``, ``json_object``), vLLM's ``structured_outputs`` extra, the official ``openai``
client (``create`` and ``parse``) and LangChain's ``with_structured_output``, over real HTTP.

The JSON server runs a one-layer tiny random model over the JSON character vocabulary: what it
writes is valid because it is constrained, whatever its weights. Random weights could write
whitespace for ever where JSON allows it, so these clients ask for compact JSON
(``structured_outputs={"disable_any_whitespace": true}`` beside ``response_format``, as vLLM
merges them) and bounded schemas.
"""

import json
import re

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

from fleetlab import LLM
from fleetlab.models import load_tiny, tiny
from fleetlab.models.json_tiny import json_tokenizer
from fleetlab.serving import AsyncLLM, ServerThread
from fleetlab.structured_output.examples import SCHEMAS

COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
USER = [{"role": "user", "content": "who are you?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server():
    tok = json_tokenizer()
    model = tiny("fleet", seed=0, num_layers=1, vocab_size=tok.vocab_size)
    with ServerThread(AsyncLLM(LLM(model, tok, block_size=16, max_num_seqs=8)), "json") as s:
        yield s


@pytest.fixture(scope="module")
def shipped_server():
    model, tok = load_tiny()
    with ServerThread(AsyncLLM(LLM(model, tok, block_size=16, max_num_seqs=8)), "tiny") as s:
        yield s


def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def test_openai_create_with_a_json_schema(server):
    schema = SCHEMAS["nested"]
    r = client(server).chat.completions.create(
        model="json", messages=USER, max_tokens=64, temperature=0, extra_body=COMPACT,
        response_format={"type": "json_schema", "json_schema": {"name": "nested", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_openai_parse_with_a_pydantic_model_sampled_and_streamed(server):
    c = client(server)
    for seed in range(3):  # sampled: different outputs, each one a Person
        r = c.chat.completions.parse(model="json", messages=USER, response_format=Person, max_tokens=64,
                                     temperature=1.0, seed=seed, extra_body=COMPACT)
        assert isinstance(r.choices[0].message.parsed, Person), r.choices[0].message.content
    schema = {"type": "json_schema", "json_schema": {"name": "flags", "schema": SCHEMAS["flags"]}}
    chunks = list(c.chat.completions.create(model="json", messages=USER, max_tokens=64, temperature=0, stream=True,
                                            response_format=schema, extra_body=COMPACT))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["flags"])
    assert len(chunks) > 5 and chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_outputs_that_end_are_objects(server):
    """Any JSON object has no bound on its length: a random model may still be writing one at
    max_tokens. Those that end are JSON objects (each prompt of the batch has its own matcher)."""
    prompts = ["who are you?", "a", "b", "{", "json please", "x", "hello", "q"]
    r = client(server).completions.create(model="json", prompt=prompts, max_tokens=96, temperature=0,
                                          extra_body={"structured_outputs": {"json_object": True,
                                                                             "disable_any_whitespace": True}})
    ended = [json.loads(ch.text) for ch in r.choices if ch.finish_reason == "stop"]
    assert len(ended) >= 2 and all(isinstance(o, dict) for o in ended)
    assert all(ch.text.startswith("{") for ch in r.choices)


def test_structured_outputs_extra_on_both_endpoints(server):
    c = client(server)
    r = c.completions.create(model="json", prompt="pick one: ", max_tokens=8, temperature=0,
                             extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="json", prompt=["a", "b"], max_tokens=12, temperature=0,
                             extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert all(re.fullmatch("[A-Z]{3}-[0-9]{2}", ch.text) for ch in r.choices)  # each prompt its own matcher
    r = c.chat.completions.create(model="json", messages=USER, max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'start: "(" /[0-9]/ ")"'}})
    assert re.fullmatch(r"\([0-9]\)", r.choices[0].message.content)


BAD = [
    # (fields sent, the field the 400 names, its code, words its message holds)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "invalid_value", "cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "invalid_value", "needs json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "invalid_value",
     "exactly one of"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs", "invalid_value", "must be a list of strings"),
    ({"structured_outputs": {"regex": "[0-9]"}, "ignore_eos": True}, "ignore_eos", "invalid_value",
     "cannot go with structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json", "unsupported", "structured_outputs={'json': ...}"),
    ({"structural_tag": "x"}, "structural_tag", "unsupported", "structural tags"),
]


@pytest.mark.parametrize("fields, param, code, words", BAD, ids=[b[1] + ":" + b[3] for b in BAD])
def test_bad_constraints_are_refused_naming_the_field(server, fields, param, code, words):
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model="json", messages=USER, max_tokens=4, extra_body=fields)
    err = info.value.body
    assert err["param"] == param and err["code"] == code and words in err["message"], err


def test_a_schema_the_served_vocabulary_cannot_spell_is_refused_naming_what_it_lacks(shipped_server):
    c = client(shipped_server)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.parse(model="tiny", messages=USER, response_format=Person, max_tokens=8)
    err = info.value.body
    assert err["param"] == "response_format.json_schema.schema" and err["code"] == "unsupported"
    assert "the served model cannot write these structured outputs" in err["message"]
    assert "it has no '\"', '{', '}'" in err["message"], err
    r = c.completions.create(model="tiny", prompt="12+7=", max_tokens=8, temperature=0,
                             extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    assert r.choices[0].text == "19"  # the trained model's own answer, and a match


def test_langchain_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model="json", base_url=server.base_url, api_key="none", temperature=0,
                                      max_tokens=64, max_retries=0, extra_body=COMPACT)
    person = llm.with_structured_output(Person).invoke("who are you?")
    assert isinstance(person, Person)
    loose = llm.with_structured_output(SCHEMAS["flags"] | {"title": "flags"}, method="json_schema").invoke("flags?")
    jsonschema.validate(loose, SCHEMAS["flags"])


def test_serve_model_tiny_json_is_the_json_capable_model():
    from fleetlab.serving.loader import load_model

    model, tok = load_model("tiny-json")
    assert tok.vocab_size == model.config.vocab_size == 88 and set('{}[]"') <= set(tok.chars)
