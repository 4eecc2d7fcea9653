"""README's reading guide lists every module one decode step passes through (``tools/read_the_engine.py``):
a decode step of the tiny model is traced, and each fleetlab module it enters must be in the guide."""

import importlib.util
import os
import sys
from pathlib import Path

import fleetlab
from fleetlab import LLM, SamplingParams
from fleetlab.models import load_tiny

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("read_the_engine", ROOT / "tools" / "read_the_engine.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def modules_of_a_decode_step(llm) -> list[str]:
    """The fleetlab files ``llm.step()`` enters, in first-call order (paths from the repository root)."""
    package = os.path.dirname(fleetlab.__file__)
    seen = []

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(package) and path not in seen:
            seen.append(path)

    sys.setprofile(profile)
    try:
        llm.step()
    finally:
        sys.setprofile(None)
    return [Path(p).relative_to(Path(package).parent).as_posix() for p in seen]


def test_the_reading_guide_lists_every_module_a_decode_step_passes_through():
    model, tokenizer = load_tiny()  # the shipped model and its tokenizer (text: the output side runs too)
    with LLM(model, tokenizer, block_size=4, max_num_batched_tokens=64) as llm:
        for i, prompt in enumerate(["12+7=", "3+4=", "100+23="]):
            llm.add_request(prompt, SamplingParams(max_tokens=8), request_id=str(i))
        for _ in range(3):  # the prompts, then decodes
            llm.step()
        assert all(r.output_token_ids for r in llm.scheduler.running)
        stepped = modules_of_a_decode_step(llm)
    guide = {name for name, _ in load_tool().PATH}
    the_models_own = {m for m in stepped if m.startswith("fleetlab/models/")}  # the tokenizer a user brings
    assert "fleetlab/engine/sampler.py" in stepped and len(stepped) > 20
    assert sorted(set(stepped) - guide - the_models_own) == []
