"""EngineNode: the engine as a managed (lifecycle) node, `oxygen_engine`; also publishes /diagnostics.

The engine itself is not a ROS entity: it is a thread that owns the device. The other nodes of the
process hold a reference to it (in-process handles: no KV and no image crosses DDS for language); they
are built around it at configure by the `attach` callable the bringup gives (see AttachedNodes).
With `robots` set (a fleet, nodes/fleet.py) it serves several robots, each with its nodes in its own
namespace; its /diagnostics then has a status per robot (`oxygen_ros: <robot> engine`) besides the totals.
A checkpoint, tokenizer or norm statistics named as a hub id or gs:// URL is fetched at configure, and each
fetch has a status of its own while it runs and after (`oxygen_ros: checkpoint download`, nodes/download_status.py).

Transitions (standard lifecycle services /oxygen_engine/change_state, get_state...):
  configure   read and check every parameter, load model, tokenizer, norm stats, KV pool; build the nodes
              around the engine (their parameters are checked too). Any problem: the node stays
              unconfigured, the reason is logged and shown in /diagnostics.
  activate    the engine thread starts, then action output and the conversation services.
  deactivate  action output stops at once, requests are refused, the engine thread stops; model loaded.
  cleanup     the nodes around the engine are destroyed and the device memory is released.
  shutdown    from any state: deactivate and clean up what is there.
"""
from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Callable, Protocol

import torch
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from std_srvs.srv import Trigger

from oxygen_ros.engine.config import EngineConfig, node_settings
from oxygen_ros.engine.tasks.actions import PREFIX_UNTRAINED
from oxygen_ros.engine.engine import Engine
from oxygen_ros.engine.factory import build_engine, file_problems, model_config
from oxygen_ros.model.checkpoint import LoadStopped, checkpoint_settings, lerobot_policy
from oxygen_ros.model.config import LIMITS, PREFIX_MODES, PRESETS
from oxygen_ros.model.download import CHECKPOINT, NORM_STATS, Wanted, is_remote, resolve_checkpoint
from oxygen_ros.model.lora import is_adapter, read_adapter
from oxygen_ros.progress import LongTask, human_bytes, size_of
from oxygen_ros.robot.policy_io import RobotIOConfig

from .download_status import Downloads
from .fleet import ROBOT_KEYS, FleetRobot, ParamsFiles, fetch_norm_stats, read_fleet, valid_name
from .params import Param, ParameterError, declare_all, read_all

# Engine settings come from EngineConfig (declared once, with their descriptions and bounds); the rest
# are how the engine is built.
ENGINE_PARAMS = [Param(name, default, description, choices, minimum, maximum)
                 for name, default, description, choices, minimum, maximum in node_settings()]
PARAMS = ENGINE_PARAMS + [
    Param("model", "tiny", "Model size: a preset (tiny, bench, pi05) or a model config file (JSON/YAML)."),
    Param("checkpoint", "", "openpi or LeRobot pi05 checkpoint: a directory (model.safetensors), the file, a hub "
                            "id org/name[@revision] or a gs:// URL (fetched once into the hub's / openpi's cache). "
                            "Empty: deterministic random weights (demo and benchmarks only)."),
    Param("checkpoint_base", "", "A PEFT LoRA adapter checkpoint's base when not the one its adapter_config.json "
                                 "names (base_model_name_or_path): a local copy or a mirror; a directory, a hub id "
                                 "org/name[@revision] or a gs:// URL. Empty: the base the adapter names."),
    Param("tokenizer", "", "SentencePiece model (the PaliGemma tokenizer for real checkpoints; a file or a gs:// "
                           "URL). Empty: the small tokenizer shipped for the tiny/bench presets."),
    Param("norm_stats", "", "openpi norm_stats.json, a checkpoint directory holding "
                            "assets/<asset_id>/norm_stats.json, or a LeRobot policy folder (its processors' "
                            "statistics and modes); a hub id or gs:// URL: its statistics fetched once. Empty: a "
                            "LeRobot checkpoint folder's own, else no (un)normalisation."),
    Param("asset_id", "", "Which assets/<asset_id> folder to take norm stats from when there are several."),
    Param("device", "auto", "Where the model runs.", choices=("auto", "cpu", "cuda")),
    Param("attention_backend", "auto", "Attention/norm kernels: Triton on CUDA, torch on the CPU.",
          choices=("auto", "torch", "triton")),
    Param("cuda_graphs", "auto", "Decode steps and denoise loops as CUDA graphs, captured at start (auto: on "
                                 "with Triton on CUDA; off: eager launches, for debugging).",
          choices=("auto", "on", "off")),
    Param("prepare_ahead", "auto", "Convert camera images (rotation, resize) on a preparer thread ahead of each "
                                   "cycle instead of on the engine thread (auto: on when the model runs on CUDA; "
                                   "on a CPU-only host the conversion competes with the model for the cores).",
          choices=("auto", "on", "off")),
    Param("kv_budget_mb", 256.0, "Memory of the paged KV pool (MiB); at most what the device has free at "
                                 "configure.", minimum=1.0),
    Param("block_size", 16, "Tokens per KV block.", minimum=1, maximum=1024),
    Param("action_horizon", 0, "Actions per chunk (0: the model's). Must match what the checkpoint was "
                               "trained with.", minimum=0, maximum=LIMITS["action_horizon"].maximum),
    Param("denoise_steps", 0, "Flow-matching steps per chunk (0: the model's).", minimum=0,
          maximum=LIMITS["num_denoise_steps"].maximum),
    Param("max_token_len", 0, "Longest prompt in tokens (0: the model's).", minimum=0,
          maximum=LIMITS["max_token_len"].maximum),
    Param("prefix_language_attention", "", "Prefix mask: bidirectional (upstream openpi, the official "
                                           "checkpoints) or causal (OxyGen code). Empty: the model's.",
          choices=("",) + PREFIX_MODES),
    Param("state_in_prompt", True, "Discretised state in the prompt (pi05 default; pi05_libero: false)."),
    Param("robot_action_dim", 0, "Action dimensions the robot uses (0: all of the model's).", minimum=0),
    Param("delta_action_mask", [], "Per action dimension: true where the model predicts a change from the "
                                   "current state (openpi delta actions, e.g. ALOHA joints); grippers false.", item=bool),
    Param("transform", "none", "Robot input/output transform around the model (aloha: openpi's adapt_to_pi "
                               "joint flips and gripper conversions).", choices=("none", "aloha")),
    Param("gripper_dims", [], "State/action dims of a linear gripper given in robot units (with gripper_range).",
          item=int),
    Param("gripper_range", [], "Robot units of the model's gripper 0 (open) and 1 (closed), e.g. a Franka "
                               "finger joint for DROID: [0.04, 0.0]. Empty: already in [0, 1].", item=float),
    Param("rotate_180", [], "Camera slots turned 180° before resizing (e.g. LIBERO from a raw robosuite render).",
          item=str),
    Param("control_period_s", 0.0, "Seconds between chunk rows: the rate the checkpoint was trained at "
                                   "(DROID 1/15, ALOHA 1/50). 0: one row per publish tick.", minimum=0.0),
    Param("torch_threads", 0, "CPU threads for torch (0: torch's default).", minimum=0, maximum=1024),
    Param("robots", [], "A fleet: the robots this engine serves (names), each configured by <name>.namespace "
                        "(default /<name>), <name>.robot_config, <name>.norm_stats, <name>.asset_id (see "
                        "docs/fleet.md). Empty: one robot, no namespace (/oxygen/...), configured by the "
                        "parameters above.", item=str),
]


class AttachedNodes(Protocol):
    """What the bringup builds around a configured engine (observation, actions, conversation...)."""

    def activate(self) -> None: ...
    def disable_output(self) -> None: ...             # action output off (an operator enables it again)
    def deactivate(self, reason: str) -> None: ...   # action output off at once, new requests refused (reason)
    def destroy(self, reason: str) -> None: ...      # every pending request answered (reason), then destroyed
    def diagnostics(self) -> list[DiagnosticStatus]: ...


# Why requests are refused (and why pending ones ended) after each transition: the client reads this.
DEACTIVATED = "engine inactive (oxygen_engine deactivated): activate it first"
CLEANED_UP = "engine unconfigured (oxygen_engine cleaned up): configure and activate it first"
SHUTTING_DOWN = "engine shutting down (oxygen_engine shutdown)"


class EngineNode(LifecycleNode):
    def __init__(self, attach: Callable[[Engine], AttachedNodes] | None = None,
                 params_files: ParamsFiles | None = None, check_capacity: bool = True, stop_loading=None,
                 **node_kwargs):
        """params_files: the parameter files this process was started with (a fleet's per-robot node
        sections and its robots' settings are checked against them). check_capacity False: the robot
        configured is a template, not a robot (oxygen_serve's clients): whether robots fit is its caller's.
        stop_loading: a threading.Event that, once set, ends a configure's model load between tensors and
        skips the capacity measurement (the process's Ctrl-C while it starts)."""
        super().__init__("oxygen_engine", **node_kwargs)
        self._check_capacity = check_capacity
        self._stop_loading = stop_loading
        self.files = params_files or ParamsFiles()
        self.fleet: list[FleetRobot] = []            # empty: the single robot ""
        # Read again at every configure (a failed configure is fixed by setting parameters, then configuring
        # again); changes are refused while configured, where they would report success and change nothing.
        self.p, _ = declare_all(self, PARAMS, read_only=False)     # checked at configure, when they are used
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._attach = attach
        self.engine: Engine | None = None
        self.attached: AttachedNodes | None = None
        self.failure = ""                          # why the last configure failed (empty: it did not)
        self.capacity = None                       # the engine's capacity prediction (capacity.py), at configure
        self.downloads = Downloads()               # this configure's fetches, as /diagnostics shows them
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_timer(1.0, self._publish_diagnostics)
        # The safe stop (max_consecutive_faults faulty frames in a row) is a latch with a reason: cleared by
        # this deliberate call, not in passing by switching output on.
        self.create_service(Trigger, "~/clear_safe_stop", self._on_clear_safe_stop)
        self.clear_safe_stop_service = self.resolve_service_name("~/clear_safe_stop")

    def _on_clear_safe_stop(self, request, response):
        """Leave the engine's safe stop. Action output is switched off at the same time: the robot moves
        again only when an operator enables it (/oxygen/enable), having seen why it stopped."""
        engine = self.engine
        if engine is None or not engine.faulted:
            response.success = False
            response.message = "no safe stop to clear" if engine is not None else "oxygen_engine is not configured"
            return response
        reason = engine.faulted
        if self.attached is not None:
            self.attached.disable_output()
        engine.reset_fault()
        response.success = True
        response.message = f"safe stop cleared (it was: {reason}); action output is off: enable it to move again"
        self.get_logger().warning(response.message)
        return response

    def _on_set_parameters(self, params) -> SetParametersResult:
        if self.engine is None:
            return SetParametersResult(successful=True)
        return SetParametersResult(successful=False, reason="oxygen_engine parameters apply at configure: "
                                                            "deactivate and clean up the node first")

    # ------------------------------------------------------------------ lifecycle transitions
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.failure = ""                          # /diagnostics shows this configure's fetches, not the last failure
        self.downloads.clear()
        self.p, problems = read_all(self, PARAMS)
        self.fleet, fleet_problems = self._read_fleet()
        problems += fleet_problems
        try:
            self.engine = self._build(problems)
            if self._attach is not None:
                self.attached = self._attach(self.engine)
        except Exception as e:  # noqa: BLE001 - configure never takes the node down: unconfigured, with why
            self._release()
            self.failure = str(e) if isinstance(e, ParameterError) else f"{type(e).__name__}: {e}"
            if self._stopping():               # not a problem of the parameters: the process is stopping
                self.get_logger().info(f"configure stopped, staying unconfigured: {self.failure}")
            else:
                self.get_logger().error("configure failed, staying unconfigured:\n  "
                                        + "\n  ".join(self.failure.splitlines()))
            return TransitionCallbackReturn.FAILURE
        self.failure = ""
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.engine.start()
        if self.attached is not None:
            self.attached.activate()
        self.get_logger().info("active: actions and conversation on")
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop(DEACTIVATED)
        self.get_logger().info("inactive: actions off, requests refused, model kept loaded")
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release(CLEANED_UP)
        self.get_logger().info("unconfigured: model released")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop(SHUTTING_DOWN)
        self._release(SHUTTING_DOWN)
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop(CLEANED_UP)
        self._release(CLEANED_UP)
        return TransitionCallbackReturn.SUCCESS     # back to unconfigured

    def _stop(self, reason: str) -> None:
        """Actions first (no command after this returns), then requests (refused from now on with `reason`;
        the engine fails the unfinished ones), then the engine thread."""
        if self.attached is not None:
            self.attached.deactivate(reason)
        if self.engine is not None:
            self.engine.stop()

    def _release(self, reason: str = CLEANED_UP) -> None:
        """The engine stops first, so every request it holds has its reply; the nodes around it then send
        every pending answer before they are destroyed."""
        if self.engine is not None:
            self.engine.stop()
        if self.attached is not None:
            self.attached.destroy(reason)
            self.attached = None
        self.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _robots(self, p: dict) -> dict:
        """build_engine's robot arguments: the single robot's I/O, or each fleet robot's I/O and norm stats."""
        if not self.fleet:
            return dict(robot_io=RobotIOConfig.from_params(p), norm_stats=p["norm_stats"] or None,
                        asset_id=p["asset_id"] or None)
        for robot in self.fleet:
            if robot.ignored:
                self.get_logger().info(f"robot {robot.name}: {robot.config_file.name}'s engine settings "
                                       f"{', '.join(robot.ignored)} are the fleet engine's: not used")
        return dict(robots={r.name: r.io for r in self.fleet},
                    norm_stats={r.name: r.norm_stats or None for r in self.fleet},
                    asset_id={r.name: r.asset_id or None for r in self.fleet})

    def _read_fleet(self) -> tuple[list[FleetRobot], list[str]]:
        """The robots of `robots` with their <name>.<key> parameters (declared here, at configure: their names
        come from `robots`), and every problem with them."""
        given = self.get_parameter("robots").value
        if isinstance(given, str):           # dynamically typed (an empty list's default): a bare name
            return [], [f"robots = {given!r}: a list of robot names, e.g. [{given}]"]
        names = [str(n) for n in self.p["robots"]]
        if not names:
            return [], []
        values = {}
        for name in names:
            if not valid_name(name):
                continue                         # read_fleet names the problem; no parameter can be declared
            for key, help_text in ROBOT_KEYS.items():
                if not self.has_parameter(f"{name}.{key}"):
                    self.declare_parameter(f"{name}.{key}", "", ParameterDescriptor(
                        description=help_text.format(name), dynamic_typing=True))   # a wrong type: named below
            values[name] = {key: self.get_parameter(f"{name}.{key}").value for key in ROBOT_KEYS}
        return read_fleet(names, values, self.files)

    @property
    def state_label(self) -> str:
        return self._state_machine.current_state[1]

    def _build(self, problems: list[str]) -> Engine:
        p = self.p
        if p["model"] not in PRESETS and not Path(p["model"]).is_file():
            problems.append(f"model {p['model']!r} is neither a preset ({', '.join(PRESETS)}) nor a config file")
        for key in ("checkpoint", "checkpoint_base", "norm_stats", "tokenizer"):   # a hub id or gs:// URL: fetched
            if key == "checkpoint_base" and not p[key] and p["checkpoint"] and is_adapter(p["checkpoint"]):
                with contextlib.suppress(ValueError):       # a bad adapter config: the checkpoint's check says so
                    named = read_adapter(p["checkpoint"]).base_name
                    if is_remote(named):                    # the adapter's base fetched here, in /diagnostics
                        p = dict(p, checkpoint_base=named)
            if isinstance(p[key], str) and p[key] and is_remote(p[key]):
                try:
                    p = dict(p, **{key: str(self._fetch(p[key], NORM_STATS if key == "norm_stats" else CHECKPOINT,
                                                        status_name(f"{key} download")))})
                except ValueError as e:
                    problems.append(str(e))
                    p = dict(p, **{key: ""})
        self.fleet, fetch_problems = fetch_norm_stats(self.fleet, lambda robot: self._fetch(
            robot.norm_stats, NORM_STATS, status_name("norm_stats download", robot.name)))
        problems += fetch_problems
        for key in ("checkpoint", "checkpoint_base", "tokenizer", "norm_stats"):
            if p[key] and not Path(p[key]).exists():
                problems.append(f"{key} not found: {p[key]}")
        device = p["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            problems.append("device is cuda but torch sees no CUDA device")
        free = free_memory(device) if device == "cpu" or torch.cuda.is_available() else None
        if free is not None and p["kv_budget_mb"] * (1 << 20) > free:
            problems.append(f"kv_budget_mb = {p['kv_budget_mb']:g}: more than the {device} memory free now "
                            f"({human_bytes(free)}): the KV pool cannot be allocated")
        if p["torch_threads"]:
            torch.set_num_threads(p["torch_threads"])
        overrides = dict(action_horizon=p["action_horizon"] or None, num_denoise_steps=p["denoise_steps"] or None,
                         max_token_len=p["max_token_len"] or None,
                         prefix_language_attention=p["prefix_language_attention"] or None)
        # What the checkpoint was trained with (its config.json) fills unset values and must agree with set ones.
        try:
            recorded = checkpoint_settings(p["checkpoint"]) if p["checkpoint"] else {}
        except ValueError as e:
            problems.append(str(e))
            recorded = {}
        for field, value in recorded.items():
            if overrides.get(field) is None:
                overrides[field] = value
            elif overrides[field] != value:
                problems.append(f"{field} {overrides[field]} differs from the checkpoint's {value} "
                                f"({Path(p['checkpoint'])}/config.json)")
        try:
            lerobot = lerobot_policy(p["checkpoint"]) if p["checkpoint"] else None
        except ValueError as e:
            problems.append(str(e))
            lerobot = None
        cfg = None
        if not any(pr.startswith("model ") for pr in problems):
            try:
                cfg = model_config(p["model"], **overrides)
            except ValueError as e:
                problems.append(str(e))
        if cfg is not None and not self.fleet:
            problems += RobotIOConfig.from_params(p).problems(cfg.action_dim, cfg.camera_slots)
        for robot in self.fleet if cfg is not None else ():
            problems += [f"{robot.name} ({robot.config_file.name}): {problem}"
                         for problem in robot.io.problems(cfg.action_dim, cfg.camera_slots)]
        state_in_prompt = p["state_in_prompt"]
        if lerobot is not None and cfg is not None:
            cameras, camera_problems = lerobot.camera_slots(cfg.camera_slots)
            problems += camera_problems
            if not camera_problems:
                self.get_logger().info("LeRobot cameras -> slots: "
                                       + ", ".join(f"{k} -> {v}" for k, v in cameras.items()))
            # The checkpoint was trained with what its processor did; that wins over the robot config.
            state_in_prompt = lerobot.state_in_prompt
            said = "" if p["state_in_prompt"] == state_in_prompt else f" (the robot config said {p['state_in_prompt']})"
            self.get_logger().info(f"state in the prompt: {state_in_prompt}, as the LeRobot checkpoint was "
                                   f"trained{said}")
        if cfg is not None and p["rtc"] and p["rtc_correction"] == "prefix" and not cfg.prefix_conditioning:
            problems.append(PREFIX_UNTRAINED)
        # The templates formatted once and the files read (headers, statistics, tokenizer) now, so that their
        # problems are listed with the others before anything loads; the parameters' bounds are read_all's.
        engine_cfg = EngineConfig(**{q.name: p[q.name] for q in ENGINE_PARAMS},     # a bad choice: listed already
                                  cuda_graphs={"auto": None, "on": True, "off": False}.get(p["cuda_graphs"]),
                                  prepare_ahead={"auto": None, "on": True, "off": False}.get(p["prepare_ahead"]))
        problems += engine_cfg.template_problems()
        robots = self._robots(p)
        if cfg is not None:
            problems += file_problems(cfg, checkpoint=p["checkpoint"] or None,
                                      checkpoint_base=p["checkpoint_base"] or None, tokenizer=p["tokenizer"] or None,
                                      **robots)
        if problems:        # each once: a checkpoint's config.json is read for its settings and its policy
            raise ParameterError("\n".join(dict.fromkeys(problems)))
        source = p["checkpoint"] or "random weights (no checkpoint)"
        size = f" ({human_bytes(size_of(p['checkpoint']))})" if p["checkpoint"] else ""
        if self._stopping():
            raise ParameterError("configure stopped before the load")
        try:
            engine_cfg.validate()
            with LongTask(f"loading model {p['model']} from {source}{size} on {device}", self.get_logger().info):
                engine = build_engine(
                    cfg, checkpoint=p["checkpoint"] or None, checkpoint_base=p["checkpoint_base"] or None,
                    tokenizer=p["tokenizer"] or None, engine=engine_cfg,
                    device=device, kv_budget_mb=p["kv_budget_mb"], block_size=p["block_size"],
                    backend=None if p["attention_backend"] == "auto" else p["attention_backend"],
                    state_in_prompt=state_in_prompt, seed=p["seed"], stop=self._stop_loading, **robots)
        except LoadStopped as e:
            raise ParameterError(str(e)) from None
        except (ValueError, FileNotFoundError) as e:
            raise ParameterError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a corrupt file, a device error: say which load failed
            raise ParameterError(f"loading {source} failed: {type(e).__name__}: {e}") from None
        for name, preparer in engine.preparers.items():
            self.get_logger().info(f"policy I/O{f' of {name}' if name else ''}: {preparer.io.description}")
        serves = (f", serving {len(self.fleet)} robots: "
                  + ", ".join(f"{r.name} ({r.namespace}, {r.config_file.name}, {engine.robot_info(r.name).action_dim} "
                              f"action dims)" for r in self.fleet)) if self.fleet else ""
        self.get_logger().info(f"engine ready: {p['model']} from {source} on {device}, policy {p['policy']}, "
                               f"{engine.info.kv_blocks} KV blocks of {engine.info.block_size} tokens, "
                               f"attention {engine.info.attention_backend}, CUDA graphs "
                               f"{'on' if engine.info.cuda_graphs else 'off'}{serves}")
        if engine.stats.counter("graph_capture_failures"):
            self.get_logger().warning(engine.stats.last_error)
        if not self._check_capacity or self._stopping():
            return engine
        try:
            self.capacity = engine.capacity()      # measured on the model now (or frame_cost_ms declared)
        except ValueError as e:                    # strict_capacity
            raise ParameterError(str(e)) from None
        # One call site per severity: rclpy refuses a call site whose severity changes between calls, which
        # failed the next configure when the verdict changed (load, another fleet).
        if self.capacity.short:
            self.get_logger().warning(self.capacity.summary())
        else:
            self.get_logger().info(self.capacity.summary())
        return engine

    def _stopping(self) -> bool:
        return self._stop_loading is not None and self._stop_loading.is_set()

    def _fetch(self, name: str, wanted: Wanted, diagnostic: str):
        """resolve_checkpoint, its progress published on /diagnostics (status `diagnostic`) from the download's
        own thread: configure holds the executor that runs the diagnostics timer."""
        def watch(state):
            self.downloads.update(diagnostic, state)
            self._publish_diagnostics()

        return resolve_checkpoint(name, self.get_logger().info, wanted=wanted, watch=watch)

    # ------------------------------------------------------------------ diagnostics
    def _publish_diagnostics(self) -> None:
        msg = DiagnosticArray()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.status.extend(self._engine_status())
        msg.status.extend(status(*report) for report in self.downloads.reports())
        if self.attached is not None:
            msg.status.extend(self.attached.diagnostics())
        self._diag_pub.publish(msg)

    def _engine_status(self) -> list[DiagnosticStatus]:
        lifecycle = self.state_label
        if self.engine is None:
            if self.failure:
                return [status("oxygen_ros: engine", DiagnosticStatus.ERROR, f"configure failed: {self.failure}",
                               {"lifecycle": lifecycle})]
            return [status("oxygen_ros: engine", DiagnosticStatus.WARN, lifecycle, {"lifecycle": lifecycle})]
        s = self.engine.stats.snapshot()
        level, message = DiagnosticStatus.OK, "running"
        if lifecycle != "active":
            level, message = DiagnosticStatus.WARN, f"{lifecycle}: model loaded, actions off"
        elif self.engine.faulted:
            level, message = DiagnosticStatus.ERROR, f"safe stop: {self.engine.faulted}"
        elif self.capacity is not None and self.capacity.short:
            level, message = DiagnosticStatus.WARN, f"predicted short of chunk periods: {self.capacity.summary()}"
        elif s["frames"] == 0:
            level, message = DiagnosticStatus.WARN, "no frame processed yet"
        elif s["frame_ms_mean"] > 1e3 * self.engine.info.frame_period_s:
            level, message = DiagnosticStatus.WARN, "frames slower than the action horizon lasts"
        values = {"lifecycle": lifecycle}
        if not self.fleet:                          # the single robot: its own figures here
            robot = s["robots"].get("", {})
            values.update(chunks_per_s=robot.get("chunks_per_s", 0.0),
                          predicted_chunks_per_s=self._predicted(""), needed_chunks_per_s=self._needed(""))
        values.update({k: s[k] for k in ("frames", "frame_ms_mean", "frame_ms_p99", "prefill_ms_mean", "action_ms_mean",
                                         "action_hz", "tokens_per_s", "avg_batch", "deadline_misses", "dropped_frames",
                                         "faults", "active_requests", "queued_requests", "pool_blocks_used",
                                         "pool_blocks_total", "pool_occupancy", "graph_replays", "graph_fallbacks")})
        values["cuda_graphs"] = self.engine.info.cuda_graphs
        values["prepare_ahead"] = self.engine.prepare_ahead
        values["last_error"] = s["last_error"]
        return [status("oxygen_ros: engine", level, message, values)] + [
            self._robot_status(robot.name, s["robots"][robot.name], lifecycle) for robot in self.fleet]

    def _robot_status(self, robot: str, s: dict, lifecycle: str) -> DiagnosticStatus:
        """A fleet robot's side of the engine: its frames, chunks, deadline misses, chunk latency and the
        observations it lost (dropped: replaced by a newer one; deferred: left for the next cycle)."""
        level, message = DiagnosticStatus.OK, "running"
        if lifecycle != "active":
            level, message = DiagnosticStatus.WARN, f"{lifecycle}: actions off"
        elif s["chunks"] == 0:
            level, message = DiagnosticStatus.WARN, "no chunk for this robot yet"
        elif robot in (self.capacity.short if self.capacity is not None else ()):
            level, message = DiagnosticStatus.WARN, (f"predicted {self._predicted(robot):.1f} chunks/s, needs "
                                                     f"{self._needed(robot):.1f}: the fleet does not fit")
        return status(status_name("engine", robot), level, message,
                      dict(s, chunk_period_s=self.engine.robot_info(robot).chunk_period_s,
                           predicted_chunks_per_s=self._predicted(robot), needed_chunks_per_s=self._needed(robot)))

    def _predicted(self, robot: str) -> float:
        return self.capacity.chunks_per_s.get(robot, 0.0) if self.capacity is not None else 0.0

    def _needed(self, robot: str) -> float:
        return self.capacity.needed_per_s.get(robot, 0.0) if self.capacity is not None else 0.0


def free_memory(device: str) -> int | None:
    """Bytes free for a new allocation on `device` now (CPU: the kernel's MemAvailable), None if unknown."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def status_name(what: str, robot: str = "") -> str:
    """A diagnostic status name: `oxygen_ros: actions` for the single robot, `oxygen_ros: arm_a actions` for
    robot arm_a of a fleet."""
    return f"oxygen_ros: {robot} {what}" if robot else f"oxygen_ros: {what}"


def status(name: str, level, message: str, values: dict) -> DiagnosticStatus:
    st = DiagnosticStatus(name=name, level=level, message=message, hardware_id="oxygen_ros")
    st.values = [KeyValue(key=k, value=f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in values.items()]
    return st
