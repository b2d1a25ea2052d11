"""generation.py: chat and plain-text generation, where replies stop, sampling, sample_generations.json,
prompts that fit a corpus, the export's generation config and loading an exported model back."""

import json

import pytest
import torch
from chats import PROMPTS, REPLIES

from tinyllm.common import UserError
from tinyllm.model import config as model_config
from tinyllm.model import generation


def test_generate_chat_stops_at_im_end_and_batching_changes_nothing(chat_model):
    model, tokenizer = chat_model
    one_by_one = generation.generate_chat(model, tokenizer, PROMPTS, max_new_tokens=24, device="cpu", batch_size=1)
    batched = generation.generate_chat(model, tokenizer, PROMPTS, max_new_tokens=24, device="cpu", batch_size=4)
    assert one_by_one == REPLIES
    assert batched == REPLIES

    # Without the stop tokens the model would go on past <|im_end|>: stopping is what ends the reply.
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    raw = model.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    continued = tokenizer.decode(raw[0, inputs["input_ids"].shape[1] :], skip_special_tokens=False)
    assert continued.startswith("Hello there!<|im_end|>") and len(continued) > len("Hello there!<|im_end|>")

    details = generation.generate_chat_details(
        model, tokenizer, [[{"role": "user", "content": "Name a color."}]], max_new_tokens=24
    )
    assert details == [{"completion": "Blue", "stopped": True, "new_tokens": 1}]
    assert model.training is False


def test_generation_restores_train_mode_and_caps_new_tokens(chat_model):
    model, tokenizer = chat_model
    model.train()
    try:
        details = generation.generate_chat_details(model, tokenizer, ["What is 10 plus 7?"], max_new_tokens=3)
        assert model.training is True
    finally:
        model.eval()
    assert details[0]["stopped"] is False and details[0]["new_tokens"] == 3


def test_cut_at_stop_and_unwrap():
    assert generation.cut_at_stop([7, 8, 2, 9, 4], [4, 2]) == ([7, 8], True)
    assert generation.cut_at_stop([7, 8, 4, 2], [4, 2]) == ([7, 8], True)
    assert generation.cut_at_stop([7, 8], [4, 2]) == ([7, 8], False)

    model = model_config.build_model(model_config.PRESETS["tiny"], 64)

    class FakeDDP(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert generation.unwrap_model(FakeDDP(torch.compile(model))) is model


def test_generate_samples_records_replies_and_never_raises(chat_model, tmp_path, monkeypatch):
    model, tokenizer = chat_model
    out = tmp_path / "sample_generations.json"
    result = generation.generate_samples(model, tokenizer, out, prompts=PROMPTS[2:], max_new_tokens=16, step=200)
    written = json.loads(out.read_text())
    assert written == result
    assert result["error"] is None and result["step"] == 200
    assert [(s["prompt"], s["completion"], s["stopped"]) for s in written["samples"]] == [
        ("Say hello.", "Hello there!", True),
        ("Name a color.", "Blue", True),
    ]
    assert written["settings"]["decoding"] == "greedy" and written["settings"]["max_new_tokens"] == 16

    def out_of_memory(**kwargs):
        raise RuntimeError("CUDA out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(model, "generate", out_of_memory)
        failed = generation.generate_samples(model, tokenizer, out, prompts=["hi"])
    assert "RuntimeError: CUDA out of memory" in failed["error"] and failed["samples"] == []
    assert json.loads(out.read_text())["error"] == failed["error"]

    unwritable = generation.generate_samples(model, tokenizer, tmp_path, prompts=["Say hello."], max_new_tokens=8)
    assert "writing" in unwritable["error"] and unwritable["samples"][0]["completion"] == "Hello there!"


def test_sampling_is_seeded_reproducible_and_leaves_the_callers_rng_alone(chat_model):
    model, tokenizer = chat_model
    greedy = generation.generate_chat(model, tokenizer, PROMPTS, max_new_tokens=24)
    # top-k 1 keeps only the likeliest token: sampling it is greedy decoding
    assert generation.generate_chat(model, tokenizer, PROMPTS, 24, sampling=generation.Sampling(1.0, top_k=1)) == greedy
    hot = generation.Sampling(temperature=3.0, top_p=0.95, seed=7)
    state = torch.random.get_rng_state()
    first = generation.generate_chat(model, tokenizer, PROMPTS, 24, sampling=hot)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert generation.generate_chat(model, tokenizer, PROMPTS, 24, sampling=hot) == first != greedy
    other = generation.generate_chat(model, tokenizer, PROMPTS, 24, sampling=generation.Sampling(3.0, 0.95, seed=8))
    assert other != first
    text = generation.generate_text_details(model, tokenizer, ["What is"], 8, sampling=hot)
    assert generation.generate_text_details(model, tokenizer, ["What is"], 8, sampling=hot) == text
    assert generation.Sampling().describe() == {"decoding": "greedy"}
    assert hot.describe() == {"decoding": "sampled", "temperature": 3.0, "top_p": 0.95, "top_k": 0, "seed": 7}


@pytest.mark.parametrize(
    "values, message",
    [
        ({"temperature": -1.0}, r"--temperature must be 0 \(greedy\) or positive"),
        ({"top_p": 0.0}, r"--top-p must be in \(0, 1\]"),
        ({"top_k": -2}, "--top-k must not be negative"),
    ],
)
def test_bad_sampling_options_name_the_option(values, message):
    defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    with pytest.raises(UserError, match=message):
        generation.sampling_from({**defaults, **values})
    prefixed = {f"sample_{key}": value for key, value in {**defaults, **values}.items()}
    with pytest.raises(UserError, match=message.replace("--", "--sample-")):
        generation.sampling_from(prefixed, "sample_")


@pytest.mark.parametrize("context, max_new_tokens", [(None, 256), (128, 96), (4096, 256), (4, 3), (1, 1)])
def test_the_exports_generation_config_leaves_a_quarter_of_the_context_to_the_prompt(
    chat_model, context, max_new_tokens
):
    _, tokenizer = chat_model
    config = generation.generation_config_for(tokenizer, context)
    assert config.max_new_tokens == max_new_tokens
    assert config.eos_token_id == generation.stop_token_ids(tokenizer) and config.do_sample is False


def test_loading_a_folder_that_is_no_export_names_what_it_lacks(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"is not an exported model folder \(no tokenizer.json\)"):
        generation.load_exported(str(tmp_path), "cpu")


@pytest.mark.parametrize(
    "given, text, recorded, expected",
    [
        (["Hi"], False, (True, ["Once"]), (False, ["Hi"])),  # prompts given: those
        (["Once upon"], True, None, (True, ["Once upon"])),
        (None, False, (False, ["What is tea?"]), (False, ["What is tea?"])),  # the run's held-out questions
        (None, False, (True, ["The river"]), (True, ["The river"])),  # the run's text openings, continued
        (None, True, (True, ["The river"]), (True, ["The river"])),
        (None, False, None, (False, generation.DEFAULT_PROMPTS)),  # no run beside the model: built-in
    ],
)
def test_samples_without_prompts_take_the_run_s_own(given, text, recorded, expected):
    assert generation.sample_prompts(given, text, recorded) == expected


def test_samples_text_needs_text_to_continue():
    for recorded in (None, (False, ["What is tea?"])):
        with pytest.raises(UserError, match="samples --text continues the text you give"):
            generation.sample_prompts(None, True, recorded)


def test_the_run_s_recorded_prompts_are_read_with_their_kind(tmp_path):
    samples = tmp_path / "sample_generations.json"
    assert generation.recorded_prompts(samples) is None  # no run beside the model
    for chat, expected in ((True, False), (False, True)):
        record = {"settings": {"chat_template": chat}, "samples": [{"prompt": "a", "completion": "b"}, {"x": 1}]}
        samples.write_text(json.dumps(record))
        assert generation.recorded_prompts(samples) == (expected, ["a"])
    samples.write_text(json.dumps({"samples": [], "error": "generation failed"}))
    assert generation.recorded_prompts(samples) is None
