"""Everything the engine will run is checked when it is configured: the format templates are formatted once,
the seed is in the noise generator's range, every setting has its type and bounds, and the model settings a
parameter, a model config file or a checkpoint's config.json may set share one set of bounds
(model/config.py LIMITS)."""
from __future__ import annotations

import json

import pytest

from oxygen_ros.engine.config import SEED_MAX, EngineConfig, node_settings
from oxygen_ros.model.config import LIMITS, load_config, preset


@pytest.mark.parametrize("name, template, said", [
    # Before: '{text}{0}' and '{foo}' passed and every question failed with IndexError / KeyError.
    ("question_template", "{text}{0}", "{0} is not a field it may use ({text}; write {{ and }} for a literal brace)"),
    ("question_template", "{foo} {text}", "{foo} is not a field it may use ({text};"),
    ("question_template", "{}{text}", "{} is not a field it may use"),
    ("question_template", "{text.upper}", "{text.upper} is not a field it may use"),
    ("question_template", "{text[0]}", "{text[0]} is not a field it may use"),
    ("question_template", "{text", "expected '}' before end of string (write {{ and }} for a literal brace)"),
    ("question_template", "}{text}", "Single '}' encountered in format string"),
    ("question_template", "{text!r}", "{text} takes no format spec or conversion"),
    ("question_template", "{text:>1000000000}", "{text} takes no format spec or conversion"),   # 1 GB per question
    ("question_template", "Question:", "must contain {text}"),
])
def test_a_template_the_engine_could_not_format_is_refused_in_one_line(name, template, said):
    problems = EngineConfig(**{name: template}).problems()
    assert len(problems) == 1 and problems[0].startswith(f"{name} {template!r}: ") and said in problems[0], problems


@pytest.mark.parametrize("name, template, fields", [
    ("question_template", "Q: {text}\n", dict(text="where is the cube?")),
    ("question_template", "{{literal}} {text}", dict(text="x")),
])
def test_a_template_that_formats_is_accepted(name, template, fields):
    assert EngineConfig(**{name: template}).problems() == []
    template.format(**fields)                       # what the engine does with it on every question/frame


def test_the_engine_refuses_a_bad_template_when_built_not_on_each_question():
    """Before: the engine was built, and each question's connection closed with an IndexError traceback."""
    from oxygen_ros.engine.factory import build_engine

    with pytest.raises(ValueError, match=r"question_template '\{text\}\{0\}': \{0\} is not a field"):
        build_engine("tiny", engine=EngineConfig(question_template="{text}{0}"), kv_budget_mb=8.0)


@pytest.mark.parametrize("seed, said", [
    (-1, "seed must be >= 0, got -1"),                      # before: started, then no chunk ever came
    (SEED_MAX + 1, f"seed must be <= {SEED_MAX}, got {SEED_MAX + 1}"),
    (1.5, "seed must be an integer, got 1.5"),
    (True, "seed must be an integer, got True"),
])
def test_the_seed_is_bounded_and_an_integer(seed, said):
    assert EngineConfig(seed=seed).problems() == [said]


def test_the_seed_bounds_are_the_noise_generators_and_the_ros_parameters():
    import numpy as np
    import torch

    for seed in (0, SEED_MAX):                              # both ends draw noise as the engine does
        state = int(np.random.SeedSequence([seed, 7]).generate_state(1)[0])
        torch.Generator().manual_seed(state)
        torch.Generator().manual_seed(seed)                 # the random demo weights' seed
    settings = {name: (minimum, maximum) for name, _, _, _, minimum, maximum in node_settings()}
    assert settings["seed"] == (0, SEED_MAX) == (0, 2**63 - 1)   # a ROS integer parameter's range


@pytest.mark.parametrize("changes, said", [
    (dict(tokens_per_frame=2.5), "tokens_per_frame must be an integer, got 2.5"),
    (dict(max_active_requests=True), "max_active_requests must be an integer, got True"),
    (dict(strict_capacity=1), "strict_capacity must be true or false, got 1"),
    (dict(action_rate_hz="70"), "action_rate_hz must be a number, got '70'"),
    (dict(question_template=3), "question_template must be text, got 3"),
    (dict(denoise_steps=10**8), f"denoise_steps must be <= {LIMITS['num_denoise_steps'].maximum}, got 100000000"),
    (dict(denoise_steps=0), "denoise_steps must be >= 1, got 0"),
])
def test_each_setting_has_its_type_and_bounds(changes, said):
    assert said in EngineConfig(**changes).problems()


def test_the_engine_node_bounds_the_model_settings_from_the_one_place():
    """The engine node's action_horizon / denoise_steps / max_token_len parameters and a checkpoint's
    config.json are bounded by model/config.py's LIMITS (one source: a checkpoint's 3000-row chunk was
    served although the parameter stopped at 1000)."""
    from oxygen_ros.nodes.engine_node import PARAMS

    params = {p.name: p for p in PARAMS}
    for param, field in (("action_horizon", "action_horizon"), ("denoise_steps", "num_denoise_steps"),
                         ("max_token_len", "max_token_len")):
        assert params[param].maximum == LIMITS[field].maximum
    for field, limit in LIMITS.items():
        assert getattr(preset("pi05"), field) <= limit.maximum
        with pytest.raises(ValueError, match=f"{field} must be an integer in \\[1, {limit.maximum}\\]"):
            preset("tiny").replace(**{field: limit.maximum + 1})
        assert getattr(preset("tiny").replace(**{field: limit.maximum}), field) == limit.maximum


def _tiny_with(**changes) -> str:
    return json.dumps(dict(json.loads(json.dumps(preset("tiny").to_dict())), **changes))


@pytest.mark.parametrize("name, text, said", [
    ("model.yaml", "vlm: [1\n", "not valid YAML"),                          # before: a yaml ScannerError escaped
    ("model.yaml", "vlm: {width: 8}\nexpert: {}\nvision: {}\nvocab_size: 10\n", "missing"),  # before: a TypeError
    ("model.json", _tiny_with(num_denoise_steps=1e8),
     "num_denoise_steps must be an integer in [1, 1000], got 100000000.0"),   # before: accepted
])
def test_a_broken_model_config_file_is_a_value_error_naming_it(tmp_path, name, text, said):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        load_config(path)
    assert str(refused.value).startswith(f"{path}: ") and said in str(refused.value), refused.value
