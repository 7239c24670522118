"""EngineConfig: every engine setting, declared once. Each field carries its description and bounds; the
engine validates from them, and the engine node generates its ROS parameters from them (fields marked
`ros=False` are not node parameters: templates, test and benchmark switches). The format templates are
formatted once when validated, with the fields the engine fills in, so a template the engine could not
format is refused at configure, not on every question."""
from __future__ import annotations

import math
import numbers
import string
from dataclasses import dataclass, field, fields
from typing import Any

from oxygen_ros.model import rtc as rtc_fns
from oxygen_ros.model.config import LIMITS

POLICIES = ("isolated", "shared_kv", "oxygen")
HIERARCHY_MODES = ("auto", "off", "pi052", "joint")
SEED_MAX = (1 << 63) - 1           # a ROS integer parameter's largest value
# The format templates and the fields the engine fills each with (and no others: no positional `{0}`, no
# attribute or index, no format spec); a question template without its question would ask nothing.
TEMPLATES = {"question_template": ("text",)}
REQUIRED_FIELDS = {"question_template": "text"}


def setting(default: Any, description: str, *, minimum: float | None = None, maximum: float | None = None,
            choices: tuple = (), ros: bool = True):
    return field(default=default, metadata=dict(description=description, minimum=minimum, maximum=maximum,
                                                choices=choices, ros=ros))


@dataclass
class EngineConfig:
    policy: str = setting("oxygen", "Scheduling policy (isolated and shared_kv exist for comparisons).",
                          choices=POLICIES)
    action_rate_hz: float = setting(70.0, "Publish rate of commands (chunk rows are control_period_s apart; the "
                                          "frame period is horizon / rate).", minimum=1.0, maximum=1000.0)
    decode_budget: str = setting("deadline", "Language decode steps per frame: until the next chunk is due "
                                             "(deadline) or a fixed tokens_per_frame.", choices=("deadline", "fixed"))
    tokens_per_frame: int = setting(5, "Decode steps per frame with decode_budget=fixed (the paper's setting).",
                                    minimum=1)
    min_tokens_per_frame: int = setting(1, "Decode steps every active request gets per frame even when late.",
                                        minimum=0)
    prefill_chunk_tokens: int = setting(64, "Question tokens prefilled per cycle at least while questions wait "
                                            "(decode_budget=deadline adds what fits before the deadline; fixed: "
                                            "exactly this many); a longer question spreads over cycles.",
                                        minimum=1)
    max_active_requests: int = setting(32, "Largest decode batch.", minimum=1)
    # None: on when the model runs on CUDA (the CPU is free while the device computes). On a CPU-only host
    # the conversion and the model compete for the same cores: measured slower there (README, issue #12).
    prepare_ahead: bool | None = setting(None, "Convert camera images (rotation, resize) on a preparer thread "
                                               "ahead of each cycle instead of on the engine thread.", ros=False)
    max_robots_per_cycle: int = setting(8, "Most robots' frames prefilled and denoised together in one cycle; "
                                           "more pending wait for the next cycle, earliest deadline first.",
                                        minimum=1)
    frame_cost_ms: float = setting(0.0, "Declared cost of one robot's frame (prefill + actions) for the fleet "
                                        "capacity check, in ms; 0: measured on the model at configure.",
                                   minimum=0.0)
    strict_capacity: bool = setting(False, "Refuse to start (or to add a robot) when the robots are predicted "
                                           "not to fit their chunk periods, instead of warning.")
    max_queued_requests: int = setting(64, "Conversation requests that may wait for admission in all; more are "
                                           "refused as busy.", minimum=0)
    max_queued_per_owner: int = setting(16, "Requests of one kind that one owner (a robot or client) may have "
                                            "waiting; more are refused as busy, so one owner's flood never "
                                            "refuses another's requests or captions.", minimum=0)
    max_tokens_limit: int = setting(256, "Largest max_tokens a request may ask for.", minimum=1)
    max_question_chars: int = setting(2000, "Longest question accepted (characters).", minimum=1)
    max_stop_strings: int = setting(16, "Most stop strings a request may give.", minimum=0, maximum=1024)
    max_stop_chars: int = setting(64, "Longest stop string accepted (characters).", minimum=1, maximum=4096)
    max_timeout_s: float = setting(300.0, "Longest request timeout accepted (seconds).", minimum=0.1)
    question_template: str = setting("{text}\n", "How a question is appended after the frame's prefix.")
    denoise_steps: int | None = setting(None, "Flow-matching steps (None: the model config's).",
                                        minimum=LIMITS["num_denoise_steps"].minimum,
                                        maximum=LIMITS["num_denoise_steps"].maximum, ros=False)
    memory_prompt: str = setting("Describe the scene.", "Prompt of the periodic scene captions.")
    memory_every_frames: int = setting(0, "Caption every N frames (0: off).", minimum=0)
    memory_period_s: float = setting(0.0, "Caption every S seconds (0: off).", minimum=0.0)
    memory_max_tokens: int = setting(24, "Caption length in tokens.", minimum=1)
    memory_log_size: int = setting(100, "Captions kept in the engine's log.", minimum=1)
    # Hierarchical language (pi052 formats, tasks/hierarchy.py, docs/hierarchy.md).
    hierarchy: str = setting("auto", "Hierarchical language: the model writes a subtask that conditions the actions, "
                                     "a progress memory and interjection replies (pi052: the default recipe, an "
                                     "extra prefill per text; joint: forks of the frame's own prefix). auto: what "
                                     "the checkpoint's pi052 config says, off for any other checkpoint.",
                             choices=HIERARCHY_MODES)
    subtask_period_s: float = setting(1.0, "A robot's subtask is re-generated every S seconds (LeRobot's runtime: "
                                           "1 Hz; 0: only by subtask_every_chunks).", minimum=0.0)
    subtask_every_chunks: int = setting(0, "A robot's subtask is re-generated every N delivered chunks (0: only "
                                              "by subtask_period_s; both 0: once per task).",
                                        minimum=0)
    progress_memory: bool = setting(True, "Re-write a robot's progress memory when its subtask changes (when the "
                                          "checkpoint's recipe trains it).")
    subtask_sync: bool = setting(False, "Serial reference: a frame whose subtask is due waits for it before its "
                                        "actions (LeRobot's order; for tests and A/B runs, not for serving).")
    # Real-time chunking (docs/rtc.md): the chunk of a robot whose publisher plays execution 'rtc'.
    rtc: bool = setting(False, "Real-time chunking: guide each robot's new chunk to continue the chunk its "
                               "publisher plays while it is computed (action publisher execution: rtc). Off by "
                               "default: it changes how every robot of the engine moves (docs/rtc.md).")
    # The rtc_* defaults are the measured best on the demo model (docs/rtc.md, "What was tried"): LeRobot
    # 0.6.1's correction, schedule, beta and execution horizon, and the first row the new chunk plays pinned
    # too (rtc_margin_rows).
    rtc_schedule: str = setting("linear", "RTC weights of the playing chunk's rows: 1 for the rows that play "
                                "while the chunk computes (and rtc_margin_rows more), then decaying (linear, exp) "
                                "to 0 at rtc_execution_horizon; ones: 1 up to it; zeros: the pinned rows only.",
                                choices=rtc_fns.SCHEDULES)
    rtc_max_guidance: float = setting(10.0, "RTC guidance weight clip (beta; LeRobot's 10, the paper's 5).",
                                      minimum=0.1, maximum=100.0)
    rtc_execution_horizon: int = setting(10, "Row where the RTC weights end (LeRobot's execution_horizon, its "
                                             "default 10; 0: the chunk's horizon, the paper's H - s). Cut to the "
                                             "playing chunk's remaining rows.", minimum=0)
    rtc_correction: str = setting("error", "RTC correction: error (LeRobot 0.6.1's: no backward pass), vjp "
                                           "(the paper's: a backward pass through the action expert per step) or "
                                           "prefix (the pinned rows given whole to a checkpoint trained with "
                                           "prefix conditioning: no guidance, the schedule and beta unused).",
                                  choices=rtc_fns.CORRECTIONS)
    rtc_margin_rows: int = setting(1, "RTC rows pinned (weight 1) beyond the delay: the first rows the new chunk "
                                      "plays also continue the playing chunk, so that its take-over is "
                                      "continuous (0: the paper's weights). Not applied when the delay is 0.",
                                   minimum=0)
    rtc_delay_rows: int | None = setting(None, "RTC delay in rows for every robot (None: predicted per robot "
                                               "from its measured latency; tasks/actions.py).", minimum=0,
                                         ros=False)
    max_consecutive_faults: int = setting(5, "Faulty frames in a row that trip the safe stop.", minimum=1)
    seed: int = setting(0, "Seed of the flow-matching noise and of the random demo weights.", minimum=0,
                        maximum=SEED_MAX)
    # None: on when the model runs the Triton kernels on CUDA. True on the CPU replays the same fixed-shape
    # steps eagerly (tests). The node exposes it as auto/on/off.
    cuda_graphs: bool | None = setting(None, "Decode steps and denoise loops as CUDA graphs (graphs.py).",
                                       ros=False)
    # Benchmark only: EOS is kept as an ordinary token, so every reply runs to max_tokens (or a stop
    # string); never set it when serving.
    ignore_eos: bool = setting(False, "Benchmark only: replies run to max_tokens.", ros=False)

    def validate(self) -> None:
        """Every problem at once (`problems`), in one ValueError."""
        problems = self.problems()
        if problems:
            raise ValueError("invalid engine config: " + "; ".join(problems))

    def problems(self) -> list[str]:
        return self.value_problems() + self.template_problems()

    def value_problems(self) -> list[str]:
        """Each field's type, choices and declared bounds (NaN fails every bound). The engine node's
        parameters carry the same bounds, checked as parameters."""
        problems = []
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None:
                continue
            wrong_type = _type_problem(f.type, value)
            if wrong_type:
                problems.append(f"{f.name} must be {wrong_type}, got {value!r}")
            elif meta["choices"] and value not in meta["choices"]:
                problems.append(f"{f.name} must be one of {meta['choices']}, got {value!r}")
            elif isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{f.name} must be finite, got {value}")
            elif meta["minimum"] is not None and not value >= meta["minimum"]:
                problems.append(f"{f.name} must be >= {meta['minimum']}, got {value}")
            elif meta["maximum"] is not None and not value <= meta["maximum"]:
                problems.append(f"{f.name} must be <= {meta['maximum']}, got {value}")
        return problems

    def template_problems(self) -> list[str]:
        """Each template formatted once with the fields the engine fills it with: one line per template the
        engine could not format (it would fail on every question or frame instead)."""
        problems = []
        for name, names in TEMPLATES.items():
            problem = template_problem(getattr(self, name), names, REQUIRED_FIELDS.get(name))
            if problem:
                problems.append(f"{name} {getattr(self, name)!r}: {problem}")
        return problems


def template_problem(template: Any, names: tuple[str, ...], required: str | None = None) -> str | None:
    """Why `template` cannot be a format template with the fields `names` (and `required` among them), or None."""
    if not isinstance(template, str):
        return "must be text"
    allowed = ", ".join(f"{{{n}}}" for n in names)
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:               # a lone brace
        return f"{e} (write {{{{ and }}}} for a literal brace)"
    for _, field_name, spec, conversion in parsed:
        if field_name is None:
            continue
        if field_name not in names:
            return (f"{{{field_name}}} is not a field it may use ({allowed}; write {{{{ and }}}} for a literal "
                    f"brace)")
        if spec or conversion:
            return f"{{{field_name}}} takes no format spec or conversion"
    if required and required not in {field_name for _, field_name, _, _ in parsed}:
        return f"must contain {{{required}}}"
    template.format(**dict.fromkeys(names, "x"))        # formats now that every field is known
    return None


def _type_problem(annotation: str, value: Any) -> str | None:
    """What a field's value must be, when it is not of its declared type (a bool is not an integer here)."""
    kinds = set(annotation.replace(" ", "").split("|")) - {"None"}
    if isinstance(value, bool):
        return None if "bool" in kinds else _TYPE_WORDS[sorted(kinds)[0]]
    if "int" in kinds and isinstance(value, numbers.Integral):
        return None
    if "float" in kinds and isinstance(value, numbers.Real):
        return None
    if "str" in kinds and isinstance(value, str):
        return None
    return " or ".join(_TYPE_WORDS[k] for k in sorted(kinds) if k in _TYPE_WORDS) or None


_TYPE_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "text"}


def node_settings() -> list:
    """(name, default, description, choices, minimum, maximum) of the settings a node exposes."""
    return [(f.name, f.default, f.metadata["description"], f.metadata["choices"], f.metadata["minimum"],
             f.metadata["maximum"]) for f in fields(EngineConfig) if f.metadata["ros"]]
