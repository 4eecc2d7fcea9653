"""Structured outputs, engine-independent half: params, the llguidance backend driven by hand,
the device bitmask against numpy, the vocabulary check, the compile-ahead manager, and
constrained greedy generation on tiny models (every output validated with ``jsonschema``)."""

import json
import re
import threading

import numpy as np
import paddle
import pytest

import fleetlab.lab  # noqa: F401  (the lab quiets library notices first)
from fleetlab.device import upload
from fleetlab.errors import FieldTypeError
from fleetlab.models.json_tiny import json_tokenizer
from fleetlab.models.pretrained import WEIGHTS_DIR
from fleetlab.models.tokenizer import CharTokenizer
from fleetlab.structured_output import (
    StructuredOutputsParams,
    get_grammar_backend,
    list_grammar_backends,
    make_grammar_backend,
    register_grammar_backend,
)
from fleetlab.structured_output.bitmask import apply_token_bitmask, dead_rows
from fleetlab.structured_output.examples import MAX_JSON_CHARS, SCHEMAS
from fleetlab.structured_output.guidance import GuidanceBackend
from fleetlab.structured_output.manager import StructuredOutputManager

jsonschema = pytest.importorskip("jsonschema")

P = StructuredOutputsParams
PERSON = SCHEMAS["person"]


@pytest.fixture(scope="module")
def json_backend():
    return GuidanceBackend(json_tokenizer())


@pytest.fixture(scope="module")
def shipped_tokenizer():
    return CharTokenizer.load(WEIGHTS_DIR)


@pytest.fixture(scope="module")
def shipped_backend(shipped_tokenizer):
    return GuidanceBackend(shipped_tokenizer)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_bos=False)


def allowed(backend, matcher) -> set[int]:
    row = backend.allocate_bitmask(1)
    row[:] = 0
    matcher.fill_bitmask(row, 0)
    bits = np.unpackbits(row[0].view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits[: backend.vocab_size])}


def compiled(backend, **fields):
    return backend.compile(P(**fields).validate("r"))


# --- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
    ({"json": "{not json"}, "field json is not valid JSON text"),
    ({"json": [1, 2]}, "field json=[1, 2] must be a JSON schema"),
    ({"choice": []}, "field choice is an empty list"),
    ({"choice": "yes"}, "field choice='yes' must be a list of strings"),
    ({"choice": ["a", 3]}, "field choice[1]=3 must be a str"),
    ({"choice": ["a", ""]}, "field choice[1] is an empty string"),
    ({"regex": 5}, "field regex=5 must be a str"),
    ({"grammar": ""}, "field grammar is empty"),
    ({"json_object": False}, "field json_object=False must be True"),
    ({"regex": "a", "disable_any_whitespace": True}, "apply to json and json_object only"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace='yes' must be True or False"),
])
def test_params_refuse_malformed_constraints_naming_request_and_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        P(**fields).validate("req-7")
    assert "request 'req-7'" in str(info.value)


def test_params_type_errors_are_value_errors_too():
    with pytest.raises(FieldTypeError):
        P(regex=5).validate("r")
    assert issubclass(FieldTypeError, ValueError)


def test_params_coerce_a_dict_and_refuse_unknown_fields():
    assert P.coerce({"regex": "[0-9]+"}, "r") == P(regex="[0-9]+")
    with pytest.raises(ValueError, match=r"request 'r': structured_outputs has unknown fields \['structural_tag'\]"):
        P.coerce({"json": {}, "structural_tag": "x"}, "r")
    with pytest.raises(TypeError, match="must be a StructuredOutputsParams or a dict"):
        P.coerce("json", "r")


def test_cache_key_is_canonical():
    a = P(json={"type": "object", "properties": {"x": {"type": "integer"}}}).validate()
    b = P(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}').validate()
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != P(json=a.json, disable_any_whitespace=True).validate().cache_key()
    assert P(choice=["a", "b"]).validate().cache_key() != P(choice=["b", "a"]).validate().cache_key()
    hash(P(choice=["a", "b"]).validate().cache_key())


def test_validate_leaves_the_original_alone():
    original = P(json='{"type": "integer"}')
    checked = original.validate()
    assert original.json == '{"type": "integer"}' and checked.json == {"type": "integer"}


# --- the backend and its registry -----------------------------------------------------------


def test_registry_lists_guidance_and_takes_new_backends():
    assert "guidance" in list_grammar_backends()
    assert get_grammar_backend("guidance") is GuidanceBackend
    with pytest.raises(ValueError, match="unknown grammar backend 'nope'; registered:"):
        get_grammar_backend("nope")
    with pytest.raises(TypeError, match="must be a subclass of GrammarBackend"):
        register_grammar_backend("bad", dict)
    with pytest.raises(ValueError, match="'module:Class'"):
        register_grammar_backend("bad", "no_colon")


@pytest.mark.parametrize("fields, field, message", [
    ({"json": {"type": "objekt"}}, "json", "Invalid type: objekt"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "json", "minimum (5) is greater than maximum (1)"),
    ({"json": {"type": "array", "uniqueItems": True}}, "json", 'Unimplemented keys: ["uniqueItems"]'),
    ({"json": {"type": "string", "pattern": "a{b"}}, "json", "regex parse error"),
    ({"regex": "a{b"}, "regex", "regex parse error"),
    ({"regex": "(?<=a)b"}, "regex", "regex parse error"),
    ({"grammar": "start: foo"}, "grammar", 'unknown name: "foo"'),
])
def test_a_constraint_that_cannot_compile_is_refused_at_once(fields, field, message):
    manager = StructuredOutputManager("guidance", json_tokenizer())
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        manager.validate("req-3", fields)
    assert str(info.value).startswith(f"request 'req-3': structured_outputs field {field}: cannot be compiled")
    manager.close()


def test_the_mask_is_exactly_the_tokens_the_matcher_accepts(json_backend):
    """For several states of a JSON schema: bit t of the row is set iff token t validates there."""
    tok = json_backend.tokenizer
    matcher = compiled(json_backend, json=PERSON, disable_any_whitespace=True).matcher()
    for piece in ["", '{"', 'name":"A', 'b"', ',"age":1', "2", "}"]:
        assert matcher.accept_tokens(ids(tok, piece))
        by_validation = {t for t in range(json_backend.vocab_size) if matcher.validate_tokens([t]) == 1}
        assert allowed(json_backend, matcher) == by_validation
    assert matcher.is_terminated() and allowed(json_backend, matcher) == {tok.eos_token_id}


def test_json_schema_matcher_by_hand(json_backend):
    tok = json_backend.tokenizer
    matcher = compiled(json_backend, json=PERSON).matcher()
    assert allowed(json_backend, matcher) == set(ids(tok, "{"))
    assert matcher.accept_tokens(ids(tok, "{"))
    assert allowed(json_backend, matcher) == set(ids(tok, ' \n"'))  # whitespace allowed by default
    assert matcher.accept_tokens(ids(tok, '"name": "Bo", '))
    before = allowed(json_backend, matcher)
    assert not matcher.accept_tokens(ids(tok, '"x'))  # only "age" may follow: refused, nothing changed
    assert matcher.num_accepted_tokens == len('{"name": "Bo", ')
    assert allowed(json_backend, matcher) == before
    assert matcher.validate_tokens(ids(tok, '"age": 130}')) == len('"age": 13')  # 130 > 120
    assert matcher.accept_tokens(ids(tok, '"age": 42}'))
    assert matcher.is_terminated() and not matcher.accept_tokens(ids(tok, " "))
    assert matcher.accept_tokens([tok.eos_token_id])
    matcher.rollback(1 + len('"age": 42}'))
    assert allowed(json_backend, matcher) == before
    with pytest.raises(ValueError, match="rollback"):
        matcher.rollback(100)


def test_eos_is_allowed_only_when_the_output_is_complete(json_backend):
    tok = json_backend.tokenizer
    matcher = compiled(json_backend, regex="[0-9]{1,3}").matcher()
    assert tok.eos_token_id not in allowed(json_backend, matcher)
    for digit in "123":
        matcher.accept_tokens(ids(tok, digit))
        assert tok.eos_token_id in allowed(json_backend, matcher)
    assert matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated() and allowed(json_backend, matcher) == set(ids(tok, "0123456789")) | {2}


def test_json_object_regex_choice_and_grammar_by_hand(json_backend):
    tok = json_backend.tokenizer
    cases = {
        "json_object": ({"json_object": True}, '{"a": [1, {"b": null}], "c": "d"}', "[1]"),
        "regex": ({"regex": r"[A-Z]{2}-\d{3}"}, "AB-123", "AB-12x"),
        "choice": ({"choice": ["red", "green", "blue"]}, "green", "grey"),
        "grammar": ({"grammar": 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]+/'}, "(1+(22+3))",
                    "(1+2+3)"),
    }
    for kind, (fields, good, bad) in cases.items():
        grammar = compiled(json_backend, **fields)
        matcher = grammar.matcher()
        assert matcher.accept_tokens(ids(tok, good)), kind
        assert tok.eos_token_id in allowed(json_backend, matcher), kind
        fresh = grammar.matcher()
        n = fresh.validate_tokens(ids(tok, bad))
        assert n < len(bad) and not fresh.accept_tokens(ids(tok, bad)), kind
        assert fresh.num_accepted_tokens == 0 and fresh.accept_tokens(ids(tok, bad[:n])), kind


def test_compact_json_and_a_whitespace_pattern(json_backend):
    tok = json_backend.tokenizer
    compact = compiled(json_backend, json_object=True, disable_any_whitespace=True).matcher()
    assert allowed(json_backend, compact) == set(ids(tok, "{"))
    assert not compact.accept_tokens(ids(tok, "{ "))
    spaced = compiled(json_backend, json_object=True, whitespace_pattern=r"[ ]?").matcher()
    assert spaced.accept_tokens(ids(tok, '{ "a": 1 }'))
    assert not spaced.accept_tokens(ids(tok, '\n'))


def test_draft_masks_and_rollback_of_rejected_drafts(json_backend):
    """Speculative verification: one mask per draft position; drafts past the first the grammar
    refuses get all-ones rows; the matcher is where it was. Then the rejected ones roll back."""
    tok = json_backend.tokenizer
    grammar = compiled(json_backend, json=PERSON, disable_any_whitespace=True)
    matcher = grammar.matcher()
    matcher.accept_tokens(ids(tok, '{"name":"'))
    drafts = ids(tok, 'Al"}x')  # 'A', 'l', '"' allowed; '}' is not ("age" is required)
    rows = json_backend.allocate_bitmask(len(drafts) + 1)
    rows[:] = 0
    assert matcher.fill_bitmask_with_drafts(rows, 0, drafts) == 3
    assert matcher.num_accepted_tokens == len('{"name":"')
    reference = grammar.matcher(replay=ids(tok, '{"name":"'))
    for i in range(4):
        expected = json_backend.allocate_bitmask(1)
        reference.fill_bitmask(expected, 0)
        assert np.array_equal(rows[i], expected[0]), i
        if i < 3:
            reference.accept_tokens([drafts[i]])
    assert (rows[4:] == -1).all()
    # the engine's way: accept the drafts, then roll back those verification rejected
    assert matcher.accept_tokens(drafts[:3])
    matcher.rollback(2)
    assert allowed(json_backend, matcher) == allowed(json_backend, grammar.matcher(ids(tok, '{"name":"A')))


def test_a_matcher_rebuilt_by_replay_equals_the_original(json_backend):
    tok = json_backend.tokenizer
    grammar = compiled(json_backend, json=PERSON)
    live = grammar.matcher()
    output = ids(tok, '{"name": "Zed", "ag')
    live.accept_tokens(output)
    rebuilt = grammar.matcher(replay=output)
    assert allowed(json_backend, rebuilt) == allowed(json_backend, live)
    assert rebuilt.num_accepted_tokens == live.num_accepted_tokens
    with pytest.raises(ValueError, match=r"token 1 \(\d+\) is not allowed"):
        grammar.matcher(replay=ids(tok, "{x"))


def test_a_fast_tokenizer_works_through_llguidances_own_loader():
    """A PaddleFormers fast tokenizer (byte-level BPE, trained here on a few lines) needs no stand-ins."""
    tokenizers = pytest.importorskip("tokenizers")
    from paddleformers.transformers import PreTrainedTokenizerFast

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<bos>", "<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    bpe.train_from_iterator(['{"name": "alice", "age": 31}', '{"id": 7, "tags": ["a", "b"]}'] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    backend = make_grammar_backend("guidance", tok, vocab_size=320)
    assert backend.spells_every_byte and backend.bitmask_width == 10 and backend.eos_token_id == 2
    matcher = backend.compile(P(json=PERSON).validate()).matcher()
    text = tok.encode('{"name": "al", "age": 31}', add_special_tokens=False)
    text = text["input_ids"] if isinstance(text, dict) else text
    assert matcher.accept_tokens(text) and matcher.is_terminated()


# --- the bitmask on the device ----------------------------------------------------------------


def numpy_apply(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """The plain reference: unpack every row's bits, little-endian, and mask."""
    out = logits.copy()
    for r in range(len(out)):
        bits = np.unpackbits(bitmask[r].view(np.uint8), bitorder="little")[: logits.shape[1]]
        out[r, bits == 0] = -np.inf
    return out


@pytest.mark.parametrize("vocab_size, words", [(55, 2), (64, 2), (88, 9), (1000, 32)])
def test_apply_token_bitmask_matches_numpy(vocab_size, words):
    rng = np.random.default_rng(vocab_size)
    logits = rng.standard_normal((6, vocab_size)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(6, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # all allowed
    bitmask[1, :] = 0
    bitmask[1, 0] = np.int32(-2**31)  # the sign bit alone: token 31
    got = apply_token_bitmask(paddle.to_tensor(logits), upload(bitmask)).numpy()
    np.testing.assert_array_equal(got, numpy_apply(logits, bitmask))
    assert np.isfinite(got[1]).sum() == 1 and np.isfinite(got[1, 31])


def test_apply_token_bitmask_to_some_rows_leaves_the_others_untouched():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, 88)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(2, 3), dtype=np.int64).astype(np.int32)
    rows = np.array([3, 1])
    got = apply_token_bitmask(paddle.to_tensor(logits), upload(bitmask), upload(rows)).numpy()
    expected = logits.copy()
    expected[rows] = numpy_apply(logits[rows], bitmask)
    np.testing.assert_array_equal(got, expected)
    empty = apply_token_bitmask(paddle.to_tensor(logits), upload(np.zeros((0, 3), np.int32)),
                                upload(np.zeros(0, np.int64)))
    np.testing.assert_array_equal(empty.numpy(), logits)


def test_apply_token_bitmask_refuses_a_mask_of_the_wrong_shape():
    logits = paddle.zeros([2, 88])
    with pytest.raises(ValueError, match=r"int32 \[rows, >= 3\] for 88 logits"):
        apply_token_bitmask(logits, upload(np.zeros((2, 2), np.int32)))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, upload(np.zeros((2, 3), np.int64)))
    with pytest.raises(ValueError, match="3 rows for 2"):
        apply_token_bitmask(logits, upload(np.zeros((3, 3), np.int32)))


def test_dead_rows_ignore_bits_past_the_vocabulary():
    bitmask = np.zeros((3, 2), np.int32)
    bitmask[0, 1] = 1 << 30  # token 62: past a 55-token vocabulary (a stand-in)
    bitmask[1, 1] = 1 << 5  # token 37
    bitmask[2] = -1
    assert dead_rows(bitmask, 55).tolist() == [True, False, False]


# --- the vocabulary check ---------------------------------------------------------------------


@pytest.mark.parametrize("fields, lacking, example", [
    ({"json_object": True}, "'{', '}'", "{}"),
    ({"json": PERSON}, "'\"', '{', '}'", None),
    ({"json": {"type": "array"}}, "'[', ']'", "[]"),
    ({"json": {"type": "string"}}, "'\"'", '""'),
    ({"regex": "[a-z]+@x"}, "'@'", "a@x"),
])
def test_a_constraint_the_vocabulary_cannot_spell_is_refused_naming_what_it_lacks(shipped_backend, fields, lacking,
                                                                                  example):
    manager = StructuredOutputManager(shipped_backend)
    manager.submit("req-9", manager.validate("req-9", fields))
    with pytest.raises(ValueError) as info:
        manager.grammar("req-9", timeout=30)
    message = str(info.value)
    assert message.startswith(f"request 'req-9': structured_outputs field {next(iter(fields))}: cannot be spelled "
                              f"by the model's vocabulary: it has no {lacking}")
    if example is not None:
        assert f"(an output it allows: {example!r})" in message
    manager.close()


def test_json_on_the_shipped_vocabulary_names_braces_and_quotes(shipped_backend):
    example = re.escape("""(an output it allows: '{"name":"","age":0}')""")
    with pytest.raises(ValueError, match=r"""it has no '"', '\{', '\}' """ + example):
        shipped_backend.compile(P(json=PERSON).validate())


def test_choices_and_regexes_over_the_shipped_alphabet_compile(shipped_backend, shipped_tokenizer):
    for fields in ({"choice": ["yes", "no"]}, {"regex": "[0-9]+ (cat|dog)"}, {"json": {"type": "integer"}},
                   {"regex": "a{3}"}, {"grammar": 'start: "a" x\nx: "b" | "c" x'}):
        compiled(shipped_backend, **fields)
    with pytest.raises(ValueError, match=r"field choice\[1\]: 'No' cannot be spelled .* it has no 'N'"):
        compiled(shipped_backend, choice=["yes", "No"])
    # a regex only partly spellable is held to its spellable part: no dead end is ever offered
    matcher = compiled(shipped_backend, regex="(aB|b)c").matcher()
    assert allowed(shipped_backend, matcher) == set(ids(shipped_tokenizer, "b"))


def test_stand_ins_sit_past_the_vocabulary(shipped_backend, shipped_tokenizer):
    assert shipped_backend.vocab_size == len(shipped_tokenizer) == 55
    assert shipped_backend.bitmask_width * 32 > 55 and not shipped_backend.spells_every_byte
    brace = shipped_backend.tokenize("{")
    assert len(brace) == 1 and brace[0] >= 55 and shipped_backend.token_text(brace[0]) == "{"
    assert shipped_backend.tokenize("ab") == ids(shipped_tokenizer, "ab")


def test_a_dead_end_at_run_time_shows_as_a_dead_row(shipped_backend, shipped_tokenizer):
    """A grammar admitted because some output is spellable ("b") may still lead a request where
    only a missing character follows ("a" then "{"): its row allows no model token."""
    matcher = compiled(shipped_backend, grammar='start: "a" "{" | "b"').matcher()
    rows = shipped_backend.allocate_bitmask(2)
    matcher.fill_bitmask(rows, 0)
    assert matcher.accept_tokens(ids(shipped_tokenizer, "a"))
    matcher.fill_bitmask(rows, 1)
    assert dead_rows(rows, shipped_backend.vocab_size).tolist() == [False, True]


def test_filling_on_llguidances_thread_pool_gives_the_same_rows(json_backend):
    tok = json_backend.tokenizer
    grammars = [compiled(json_backend, json=SCHEMAS[name], disable_any_whitespace=True) for name in SCHEMAS]
    matchers = [(g.matcher(replay=ids(tok, prefix)), row) for row, (g, prefix) in
                enumerate(zip(grammars, ['{"name":"x', "[1,", '{"color":"', '{"id":12', '{"code":"AB']))]
    pooled = GuidanceBackend(tok, fill_threads=2)
    one_by_one, in_pool = json_backend.allocate_bitmask(5), pooled.allocate_bitmask(5)
    json_backend.fill_bitmasks(matchers, one_by_one)
    pooled.fill_bitmasks(matchers, in_pool)
    np.testing.assert_array_equal(one_by_one, in_pool)


# --- the compile-ahead manager ----------------------------------------------------------------


class GatedBackend(GuidanceBackend):
    """llguidance, but each compile waits for the test to open the gate."""

    name = "gated"
    gate = threading.Event()
    started = threading.Event()

    def compile(self, params):
        self.started.set()
        assert self.gate.wait(30)
        return super().compile(params)


def test_submit_never_waits_for_a_compile():
    register_grammar_backend("gated", GatedBackend)
    GatedBackend.gate.clear()
    manager = StructuredOutputManager("gated", json_tokenizer())
    slow = manager.validate("slow", {"json": PERSON})
    future = manager.submit("slow", slow)  # returns while the compile is blocked on the gate
    assert GatedBackend.started.wait(30)
    assert not manager.is_ready("slow") and not future.done()
    # meanwhile an already compiled grammar serves other requests (the engine's steps go on)
    other = GuidanceBackend.compile(manager.backend, P(regex="[0-9]+").validate())  # past the gate
    rows = manager.backend.allocate_bitmask(1)
    other.matcher().fill_bitmask(rows, 0)
    assert not manager.is_ready("slow")
    GatedBackend.gate.set()
    assert manager.grammar("slow", timeout=30).kind == "json" and manager.is_ready("slow")
    manager.close()


def test_one_compile_per_distinct_constraint():
    manager = StructuredOutputManager("guidance", json_tokenizer())
    a = manager.submit("a", manager.validate("a", {"json": PERSON}))
    b = manager.submit("b", manager.validate("b", {"json": json.dumps(PERSON, indent=2)}))
    c = manager.submit("c", manager.validate("c", {"json": PERSON, "disable_any_whitespace": True}))
    assert a is b and a is not c
    assert manager.grammar("a", timeout=30) is manager.grammar("b", timeout=30)
    manager.grammar("c", timeout=30)
    assert len(manager.compile_times) == 2 and all(t > 0 for t in manager.compile_times.values())
    assert manager.matcher("a") is not manager.matcher("b")  # one matcher per request
    with pytest.raises(ValueError, match="already has"):
        manager.submit("a", manager.validate("a", {"regex": "x"}))
    manager.release("a")
    with pytest.raises(KeyError):
        manager.is_ready("a")
    assert manager.stats()["num_requests"] == 2
    manager.close()


def test_a_failed_compile_is_reported_for_each_request(shipped_tokenizer):
    manager = StructuredOutputManager("guidance", shipped_tokenizer)
    for rid in ("first", "second"):
        manager.submit(rid, manager.validate(rid, {"json_object": True}))
        with pytest.raises(ValueError, match=f"^request '{rid}': structured_outputs field json_object: cannot be"):
            manager.matcher(rid)
    assert len(manager.stats()["compile_time_s"]) == 0  # failed compiles time nothing
    manager.close()


# --- constrained generation -------------------------------------------------------------------

def constrained_greedy(model, tokenizer, backend, prompts, grammars, max_tokens):
    """Greedy decoding by hand, every row masked by its own matcher's bitmask row each step.

    Prompts must share a length (one [rows, T] batch). The model's own KV cache carries the
    context between steps (checked against its full forward below). Returns each row's text
    and whether it ended with EOS."""
    rows = len(prompts)
    matchers = [g.matcher() for g in grammars]
    outputs, done = [[] for _ in range(rows)], np.zeros(rows, dtype=bool)
    bitmask = backend.allocate_bitmask(rows)
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(np.array(prompts, dtype=np.int64)), use_cache=True, return_dict=True)
        for _ in range(max_tokens):
            backend.fill_bitmasks([(m, r) for r, m in enumerate(matchers) if not done[r]], bitmask)
            assert not dead_rows(bitmask, backend.vocab_size).any()
            logits = apply_token_bitmask(out.logits[:, -1, :], upload(bitmask))
            next_ids = paddle.argmax(logits, axis=-1)
            for r, t in enumerate(next_ids.numpy().tolist()):
                if not done[r]:
                    assert matchers[r].accept_tokens([t])
                    done[r] = t == tokenizer.eos_token_id
                    if not done[r]:
                        outputs[r].append(t)
            if done.all():
                break
            out = model(input_ids=next_ids.unsqueeze(-1), past_key_values=out.past_key_values, use_cache=True,
                        return_dict=True)
    return [tokenizer.decode(o) for o in outputs], done


def test_200_constrained_generations_all_validate():
    """A tiny random model over a JSON-capable vocabulary, 40 prompts per schema, greedy:
    whatever the weights, every output parses and validates against its schema."""
    from fleetlab.models import tiny_json

    model, tok = tiny_json(seed=0)
    backend = GuidanceBackend(tok)
    rng = np.random.default_rng(0)
    prompts, grammars, names = [], [], []
    for name, schema in SCHEMAS.items():
        grammar = backend.compile(P(json=schema, disable_any_whitespace=True).validate())
        for _ in range(40):
            prompts.append([tok.bos_token_id] + rng.integers(4, tok.vocab_size, size=9).tolist())
            grammars.append(grammar)
            names.append(name)
    texts, ended = constrained_greedy(model, tok, backend, prompts, grammars, max_tokens=MAX_JSON_CHARS)
    assert ended.all(), [t for t, e in zip(texts, ended) if not e][:3]
    for name, text in zip(names, texts):
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert len(set(texts)) > 20  # the prompts lead the model to different outputs


def test_the_cached_greedy_loop_follows_the_full_forward():
    """The loop above reads the model's own KV cache; here the unpatched full forward agrees."""
    from fleetlab.models import tiny_json

    model, tok = tiny_json(seed=0)
    backend = GuidanceBackend(tok)
    grammar = backend.compile(P(json=SCHEMAS["person"], disable_any_whitespace=True).validate())
    prompt = tok.encode("name and age: ")
    (text,), _ = constrained_greedy(model, tok, backend, [prompt], [grammar], max_tokens=40)
    matcher, tokens = grammar.matcher(), list(prompt)
    bitmask = backend.allocate_bitmask(1)
    with paddle.no_grad():
        while True:
            logits = model(input_ids=paddle.to_tensor([tokens]), use_cache=False, return_dict=True).logits[:, -1, :]
            matcher.fill_bitmask(bitmask, 0)
            t = int(paddle.argmax(apply_token_bitmask(logits, upload(bitmask)), axis=-1))
            if t == tok.eos_token_id:
                break
            matcher.accept_tokens([t])
            tokens.append(t)
    assert tok.decode(tokens[len(prompt):]) == text


def test_choice_and_regex_on_the_shipped_trained_model():
    from fleetlab.models import load_tiny

    model, tok = load_tiny()
    backend = GuidanceBackend(tok)
    choices = ["cat", "dog", "old man"]
    regex = r"[0-9]{2} (red|blue) [a-z]{3,5}\."
    prompts = [tok.encode(p) for p in ("the red ", "count 4 ", "12+70=82", "the old ")]
    for fields, check in (({"choice": choices}, lambda s: s in choices),
                          ({"regex": regex}, lambda s: re.fullmatch(regex, s))):
        grammar = backend.compile(P(**fields).validate())
        for prompt in prompts:
            (text,), ended = constrained_greedy(model, tok, backend, [prompt], [grammar], max_tokens=24)
            assert ended.all() and check(text), (fields, text)


def test_the_benchmark_runs_and_reports(tmp_path, capsys):
    from fleetlab.lab.bench.structured import main

    out = tmp_path / "structured.json"
    assert main(["--repeats", "1", "--rounds", "1", "--rows", "4", "--step-runs", "1", "-q", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [s["constrained_rows"] for s in result["steps"].values()] == [0, 1, 4]
    assert all(s["steps"] > 30 and s["step_ms_median"] > s["sample_ms_median"] > 0 for s in result["steps"].values())
    assert result["compile_shipped_vocab"]["json_object"]["refused"].startswith(
        "structured_outputs field json_object: cannot be spelled")
    assert all(c["compile_ms"] > 0 for c in result["compile_json_vocab"].values())
    assert set(result["fill_json_vocab"]) == set(result["compile_json_vocab"])
    assert "| person |" in capsys.readouterr().out
