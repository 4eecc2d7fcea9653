"""The serving pieces that need no server: chat template, error mapping, and the Llama -> Fleet
converter that ``serve --model-impl fleet`` uses (text and stop strings: ``test_detokenizer.py``)."""

import numpy as np
import pytest

from fleetlab.models.tokenizer import CharTokenizer
from fleetlab.serving.chat_template import chat_prompt_ids, render_minimal
from fleetlab.serving.errors import bad_request_from_engine


class TemplateTokenizer(CharTokenizer):
    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return {"input_ids": self.encode(text)} if tokenize else text


def test_chat_template_own_or_minimal():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+7="}]
    assert render_minimal(msgs) == "be brief\n12+7="
    tok = CharTokenizer()
    assert chat_prompt_ids(tok, msgs[1:]) == tok.encode("12+7=")
    t = TemplateTokenizer()
    assert chat_prompt_ids(t, msgs) == t.encode("system: be brief\nuser: 12+7=\nassistant: ")


def test_engine_value_errors_become_400s_naming_the_field():
    from fleetlab import SamplingParams
    from fleetlab.edge.sampling import check_sampling_params

    with pytest.raises(ValueError) as e:
        check_sampling_params(SamplingParams(top_p=2.0), "cmpl-1")
    bad = bad_request_from_engine(e.value)
    assert bad.param == "top_p" and bad.status_code == 400 and not bad.message.startswith("request")
    bad = bad_request_from_engine(ValueError("request 'x': prompt_token_ids [999] outside the vocabulary [0, 55)"),
                                  "messages")
    assert bad.param == "messages" and bad.body()["error"]["type"] == "invalid_request_error"


def test_validation_error_param_names():
    from fleetlab.serving.protocol import field_path

    assert field_path(["messages", 0, "content"]) == "messages[0].content"
    assert field_path(["prompt", "list[int]", 2]) == "prompt"
    assert field_path(["stop", "str"]) == "stop"


def test_refusals_accept_only_values_that_change_nothing():
    from fleetlab.serving import refused
    from fleetlab.serving.errors import BadRequest

    no_op = refused.unset_or(0)
    assert no_op(None) and no_op(0) and no_op(0.0) and not no_op(False) and not no_op(0.5)
    assert refused.unset_or(False)(False) and not refused.unset_or(False)(0)  # 0 == False in Python
    refused.check_fields({"min_p": 0, "modalities": ["text"], "length_penalty": 1.0}, refused.CHAT)
    for fields, param in (({"modalities": ["audio"]}, "modalities"), ({"guided_choice": ["a"]}, "guided_choice"),
                          ({"nope": None}, "nope")):
        with pytest.raises(BadRequest) as e:
            refused.check_fields(fields, refused.CHAT)
        assert e.value.param == param and e.value.code == "unsupported"
    assert set(refused.COMPLETION) & set(refused.CHAT) >= {"min_p", "length_penalty", "guided_json", "bad_words"}


def test_fleet_from_llama_computes_the_same_model():
    import paddle

    from fleetlab import LLM, SamplingParams
    from fleetlab.models import load_tiny, tiny
    from fleetlab.models.convert import fleet_from_llama
    from fleetlab.serving.loader import load_model

    llama, tok = load_tiny()
    fleet = fleet_from_llama(llama)
    ids = paddle.to_tensor([tok.encode("12+7=19 count 3 4 5")])
    want = llama(input_ids=ids, use_cache=False, return_dict=True).logits.numpy()
    np.testing.assert_allclose(fleet(ids).numpy(), want, atol=1e-4)
    prompts, sp = ["45+38=", "count 3 "], SamplingParams(max_tokens=8)
    served, _ = load_model("tiny", "fleet")
    assert type(served).__name__ == "FleetForCausalLM"
    assert ([o.token_ids for o in LLM(served, tok).generate(prompts, sp, use_tqdm=False)]
            == [o.token_ids for o in LLM(llama, tok).generate(prompts, sp, use_tqdm=False)])
    with pytest.raises(ValueError, match="Llama"):
        fleet_from_llama(tiny("phi3"))
    with pytest.raises(ValueError, match="model-impl"):
        load_model("tiny", "vllm")


def test_load_model_from_a_checkpoint_directory(tmp_path):
    import shutil

    from fleetlab.models.pretrained import WEIGHTS_DIR
    from fleetlab.serving.loader import load_model

    path = tmp_path / "ckpt"
    shutil.copytree(WEIGHTS_DIR, path)  # PaddleFormers may write a metadata file next to the weights
    model, tok = load_model(str(path), "paddleformers")
    assert isinstance(tok, CharTokenizer) and type(model).__name__ == "LlamaForCausalLM"
    with pytest.raises(FileNotFoundError, match="checkpoint directory"):
        load_model(str(tmp_path / "nothing"))
