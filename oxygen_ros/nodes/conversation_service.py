"""ConversationService: /oxygen/converse (service), /oxygen/converse_stream (action), /oxygen/memory, and the
hierarchical policy's language: /oxygen/subtask, /oxygen/progress, /oxygen/plan, /oxygen/speech (topics, one
robot's each: language.py says which QoS and why) and /oxygen/interject (service).

Requests go to the engine in-process and attach to the newest frame's KV handle: no KV and no image
crosses DDS for language. The service never holds an executor thread while a reply is decoded (that
would cap the decode batch at the thread count): its callback returns a deferred response. The engine
thread only enqueues each finished reply and triggers a guard condition; the response is built, logged,
recorded in its session and sent on the services executor (`_send_replies`), like the captions (queue +
timer). rclpy gives a service callback no header, so the deferred response captures it when the executor
sends the callback's return value (`_DeferredService`). Coroutine callbacks were tried and measured: rclpy
9.1.2 resumes every pending service task on every executor wake-up, so with 300 calls pending the process
spent 55% of a core polling while idle and took only 227 of the 300 calls within 60 s.
The interjection service answers the same way (deferred); its reply is split into plan and speech
(pi052.split_plan_and_say, as the engine splits it for the robot's language state). The language topics
are published from the engine's language listener (engine thread: enqueue and wake a guard condition).
A reply with `<locNNNN>` tokens (a pi052 checkpoint's spatial answer) gets its points and boxes parsed
(pi052.parse_loc_answer) and converted to the pixels of the camera `loc_camera`, whose size the robot config
gives (`loc_image_size`; language.py says how the normalised coordinates map to pixels).
Its request queue is deep on purpose: with the default depth (keep last 10) a burst of 200 calls from
one client lost 180 of them silently in the middleware; every request that reaches the package gets a
reply or an error.

Going away (the engine node's cleanup and shutdown, Ctrl-C): `close` runs while the executors still spin.
New calls and goals are refused with the reason at once; every call already taken and every streaming
goal already accepted is answered (the engine, stopped first, fails them; the reason is put in front of
the engine's error) before the node is destroyed; then the calls still waiting in the middleware queue
are taken and refused. Nothing is sent on a destroyed service: a response after the service was
destroyed raised InvalidHandle on the services executor thread, which ended that thread (issue #21).
"""
from __future__ import annotations

import functools
import itertools
import queue
import threading
import time

from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy._rclpy_pybind11 import RCLError
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

from oxygen_ros.engine.engine import Caption, Engine
from oxygen_ros.engine.requests import Reply, Sampling, TextRequest, refused
from oxygen_ros.engine.sessions import Sessions
from oxygen_ros.model.pi052 import parse_loc_answer, split_plan_and_say
from oxygen_ros.robot.text import validate_text

from .action_output import ros_time
from .engine_node import status, status_name
from .language import TOPICS, LanguageOutbox, in_pixels, qos_for
from .params import Param, ParameterError, declare_all

MAX_STREAM_WAIT_S = 24 * 3600.0  # longest a stream waits for its reply (the engine times requests out first)
CLOSE_TIMEOUT_S = 10.0           # longest `close` waits for the executors to send the last answers
INACTIVE = "engine inactive (oxygen_engine lifecycle): activate it first"

PARAMS = [
    Param("service_name", "oxygen/converse", "Conversation service (oxygen_interfaces/srv/Converse)."),
    Param("action_name", "oxygen/converse_stream", "Streaming conversation (oxygen_interfaces/action/Converse)."),
    Param("memory_topic", "oxygen/memory", "Scene captions (oxygen_interfaces/msg/Caption)."),
    *[Param(name, default, description) for name, default, description in TOPICS.values()],
    Param("interject_service", "oxygen/interject", "Operator interjections: a new plan and a spoken reply "
                                                  "(oxygen_interfaces/srv/Interject)."),
    Param("loc_camera", "", "Camera slot the points and boxes of spatial answers refer to (empty: the model's "
                            "first camera slot)."),
    Param("loc_image_size", [], "[width, height] of loc_camera's images in pixels: spatial answers are converted "
                                "to them (empty: unknown, only the normalised coordinates are given).", item=int),
    Param("default_max_tokens", 32, "Reply length when a request asks for 0.", minimum=1),
    Param("default_timeout_s", 30.0, "Request timeout when a request asks for 0.", minimum=0.1,
          maximum=MAX_STREAM_WAIT_S),
    Param("request_queue_depth", 1000, "Service request queue in the middleware (keep-last depth).", minimum=1),
    Param("max_streams", 8, "Concurrent streaming goals (each holds one executor thread while it streams).",
          minimum=1),
    Param("session_turns", 4, "Earlier turns of a session (same session_id) put in front of its question.",
          minimum=0),
    Param("max_sessions", 100, "Sessions remembered (least recently used forgotten first).", minimum=1),
]


class _DeferredResponse:
    """A service response sent once both the reply and the request's header are known, from whichever
    thread provides the second (services-executor threads, or the thread that closes the service)."""

    def __init__(self, send):
        self._send = send
        self._lock = threading.Lock()
        self._header = None
        self._response = None

    def bind(self, header) -> None:
        with self._lock:
            self._header = header
            ready = self._response is not None
        if ready:
            self._send(self._response, header)

    def complete(self, response) -> None:
        with self._lock:
            self._response = response
            header = self._header
        if header is not None:
            self._send(response, header)


class _DeferredService:
    """The one hook into rclpy: the executor sends a callback's return value with
    `service.send_response(value, header)`; for a _DeferredResponse that call binds the header instead."""

    def __init__(self, service):
        self.service = service
        send = service.send_response
        self.send = self.send_raw = send      # `send` is wrapped by the node (never on a destroyed service)
        service.send_response = lambda response, header: (
            response.bind(header) if isinstance(response, _DeferredResponse) else send(response, header))


class ConversationService(Node):
    def __init__(self, engine: Engine, robot: str = "", **node_kwargs):
        """robot: whose camera the questions are about (a fleet's robot name; "" for the single robot)."""
        super().__init__("oxygen_conversation", **node_kwargs)
        from oxygen_interfaces.action import Converse as ConverseAction
        from oxygen_interfaces.msg import Caption as CaptionMsg
        from oxygen_interfaces.srv import Converse

        self.engine = engine
        self.robot = robot
        self.refusal = ""                   # non-empty: why requests are refused now (engine node inactive...)
        self.stopping = ""                  # non-empty: the node is going away (close); goals are rejected
        self.p, problems = declare_all(self, PARAMS)
        slots = engine.robot_info(robot).camera_slots
        self.loc_camera = self.p["loc_camera"] or slots[0]
        if self.loc_camera not in slots:
            problems.append(f"loc_camera {self.loc_camera!r} is not a camera slot of the model ({', '.join(slots)})")
        size = list(self.p["loc_image_size"])
        if size and (len(size) != 2 or min(size) < 1):
            problems.append(f"loc_image_size {size}: [width, height] in pixels, both positive (empty: unknown)")
        self.loc_size = (size[0], size[1]) if len(size) == 2 and min(size) >= 1 else (0, 0)
        if problems:
            # Destroyed now: the context's cleanup would otherwise call this class's destroy_node on a half-built node.
            Node.destroy_node(self)
            raise ParameterError("\n".join(problems))
        from oxygen_interfaces.msg import LanguageUpdate, Located
        from oxygen_interfaces.srv import Interject

        self._Converse, self._ConverseAction, self._CaptionMsg = Converse, ConverseAction, CaptionMsg
        self._Interject, self._LanguageUpdate, self._Located = Interject, LanguageUpdate, Located
        self._seeds = itertools.count(1)
        self.sessions = Sessions(self.p["session_turns"], self.p["max_sessions"], engine.info.max_question_chars)
        self.counts = {"requests": 0, "answered": 0, "failed": 0, "streams": 0, "streams_rejected": 0,
                       "interjections": 0, "language_published": 0}
        self._streams: dict = {}            # goal id -> engine handle (for cancel)
        self._stream_slots = 0              # accepted goals not finished yet
        self._streams_lock = threading.Lock()
        # Calls taken whose response has not been sent; `close` waits for none to be left.
        self._unsent = 0
        self._idle = threading.Condition()
        self._send_lock = threading.Lock()      # a send and the service's destruction never overlap
        self._destroyed = False
        self.lost = 0                           # answers that could not be sent (closing timed out)

        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=self.p["request_queue_depth"],
                         reliability=ReliabilityPolicy.RELIABLE)
        self.service = _DeferredService(self.create_service(Converse, self.p["service_name"], self._on_request,
                                                            qos_profile=qos,
                                                            callback_group=MutuallyExclusiveCallbackGroup()))
        self.interject_service = _DeferredService(self.create_service(
            Interject, self.p["interject_service"], self._on_interject, qos_profile=qos,
            callback_group=MutuallyExclusiveCallbackGroup()))
        for service in (self.service, self.interject_service):
            service.send = functools.partial(self._send, service.send)
        self._replies: queue.SimpleQueue = queue.SimpleQueue()     # (deferred, finish, reply, refusal)
        self._reply_ready = self.create_guard_condition(self._send_replies,
                                                        callback_group=MutuallyExclusiveCallbackGroup())

        # The action's goal, result and cancel services are services too: with rclpy's default keep-last-10
        # (here and in the client) a burst of 26 result requests lost 16, whose clients waited forever
        # (test_ros_fuzz.py).
        self.action_server = ActionServer(
            self, ConverseAction, self.p["action_name"], execute_callback=self._execute_stream,
            goal_callback=self._on_goal, cancel_callback=self._on_cancel, callback_group=ReentrantCallbackGroup(),
            goal_service_qos_profile=qos, result_service_qos_profile=qos, cancel_service_qos_profile=qos)

        self.memory_pub = self.create_publisher(CaptionMsg, self.p["memory_topic"], 10)
        self._captions: queue.SimpleQueue = queue.SimpleQueue()
        # Engine thread: enqueue only, this robot's captions only (the listeners get every robot's).
        engine.add_caption_listener(lambda caption: caption.robot == robot and self._captions.put(caption))
        self.create_timer(0.1, self._publish_captions, callback_group=MutuallyExclusiveCallbackGroup())

        self.language_pubs = {kind: self.create_publisher(LanguageUpdate, self.p[param], qos_for(kind))
                              for kind, (param, _, _) in TOPICS.items()}
        self._language_ready = self.create_guard_condition(self._publish_language,
                                                           callback_group=MutuallyExclusiveCallbackGroup())
        self.language = LanguageOutbox(robot, self._language_ready.trigger)
        engine.add_language_listener(self.language.put)

    def configure_introspection(self, qos, state) -> None:
        """Publish the service's and the streaming action's requests and replies as service events."""
        for server in (self.service.service, self.interject_service.service, self.action_server):
            server.configure_introspection(self.get_clock(), qos, state)

    # ------------------------------------------------------------------ request mapping
    def _text_request(self, r) -> TextRequest:
        question = validate_text(r.text, what="question", max_chars=self.engine.info.max_question_chars)
        return TextRequest(
            text=self.sessions.question(r.session_id, question), max_tokens=r.max_tokens or self.p["default_max_tokens"],
            sampling=Sampling(temperature=max(float(r.temperature), 0.0), top_p=float(r.top_p) or 1.0,
                              seed=next(self._seeds)),
            stop=tuple(s for s in r.stop if s), timeout_s=float(r.timeout_s) or self.p["default_timeout_s"],
            session_id=r.session_id, owner=self.robot)

    @property
    def active(self) -> bool:
        return not self.refusal

    @active.setter
    def active(self, active: bool) -> None:
        self.refusal = "" if active else INACTIVE

    def _submit(self, r):
        self.counts["requests"] += 1
        if self.refusal:
            return refused(TextRequest(r.text), self.refusal)
        try:
            request = self._text_request(r)
        except ValueError as e:  # an empty or invalid question, top_p out of range, a too long session id...
            return refused(TextRequest(r.text), str(e))
        try:
            return self.engine.submit(request)
        except Exception as e:  # noqa: BLE001 - escaping the callback would stop the services executor
            self.get_logger().error(f"engine refused a request: {type(e).__name__}: {e}", throttle_duration_sec=1.0)
            return refused(request, f"engine error: {type(e).__name__}: {e}")

    def _record(self, r, reply: Reply) -> None:
        """Keep a successful turn in its session: the cleaned question, not the raw request text."""
        if r.session_id and reply.success:
            question = validate_text(r.text, what="question", max_chars=self.engine.info.max_question_chars)
            self.sessions.record(r.session_id, question, reply.text)

    def _fill(self, target, reply: Reply, refusal: str = ""):
        """refusal: why requests were refused when `reply` ended ("engine stopped" alone does not say why)."""
        error = reply.error
        if not reply.success and refusal and not error.startswith(refusal):
            error = f"{refusal} (request ended: {error})"
        target.success, target.reply, target.error = reply.success, reply.text, error
        target.tokens = len(reply.tokens)
        target.frame_index = max(reply.frame_index, 0)
        target.frame_stamp = ros_time(reply.frame_stamp)
        target.queue_s, target.latency_s, target.finish_reason = reply.queue_s, reply.latency_s, reply.finish_reason
        target.located = self.located(reply.text) if reply.success else []
        self.counts["answered" if reply.success else "failed"] += 1
        # A request ended by an orderly stop or a deactivation (`refusal`) is no fault: the client is told why,
        # the log says it at info. One call site per severity: rclpy refuses a call site whose severity changes.
        if not reply.success and refusal:
            self.get_logger().info(f"conversation request ended ({reply.finish_reason}): {error}",
                                   throttle_duration_sec=1.0)
        elif not reply.success:
            self.get_logger().warning(f"conversation request failed ({reply.finish_reason}): {error}",
                                      throttle_duration_sec=1.0)
        return target

    # ------------------------------------------------------------------ service
    def located(self, text: str) -> list:
        """The points and boxes of a spatial answer as Located messages ([] when the text has none)."""
        items = parse_loc_answer(text)
        if not items:
            return []
        rotated = self.loc_camera in self.engine.preparers[self.robot].io.config.rotate_180
        width, height = self.loc_size
        return [self._Located(label=item.label, kind=item.kind, normalized=list(item.normalized),
                              pixels=list(item.pixels), camera=self.loc_camera, image_width=width,
                              image_height=height)
                for item in in_pixels(items, width, height, rotated)]

    def _on_request(self, request, response):
        with self._idle:
            self._unsent += 1
        deferred = _DeferredResponse(self.service.send)
        handle = self._submit(request)

        def finish(reply: Reply, refusal: str):
            self._record(request, reply)
            return self._fill(self._Converse.Response(), reply, refusal)

        handle.add_done_callback(lambda reply: self._queue_reply(deferred, finish, reply))
        return deferred

    def _queue_reply(self, deferred: _DeferredResponse, finish, reply: Reply) -> None:
        """Engine thread (a done-callback): hand the reply to the services executor, nothing more."""
        self._replies.put((deferred, finish, reply, self.refusal))
        self._reply_ready.trigger()

    def _send_replies(self) -> None:
        """Services executor: build, log, record and send every reply the engine finished."""
        while True:
            try:
                deferred, finish, reply, refusal = self._replies.get_nowait()
            except queue.Empty:
                return
            deferred.complete(finish(reply, refusal))

    # ------------------------------------------------------------------ interjections
    def _on_interject(self, request, response):
        with self._idle:
            self._unsent += 1
        deferred = _DeferredResponse(self.interject_service.send)
        self._interject(request).add_done_callback(
            lambda reply: self._queue_reply(deferred, self._fill_interjection, reply))
        return deferred

    def _interject(self, r):
        """The engine's handle for an interjection, or a refusal saying why it cannot be one."""
        self.counts["interjections"] += 1
        if self.refusal:
            return refused(TextRequest(r.text), self.refusal)
        if r.robot not in ("", self.robot):
            here = f"robot {self.robot}'s" if self.robot else "the single robot's"
            return refused(TextRequest(r.text), f"this interjection service is {here}, not {r.robot!r}'s: call "
                                                f"that robot's (<its namespace>/{self.p['interject_service']})")
        try:   # the engine checks the text and the timeout, and refuses without a hierarchy: each with why
            return self.engine.interject(r.text, robot=self.robot,
                                         timeout_s=float(r.timeout_s) or self.p["default_timeout_s"])
        except Exception as e:  # noqa: BLE001 - escaping the callback would stop the services executor
            self.get_logger().error(f"engine refused an interjection: {type(e).__name__}: {e}",
                                    throttle_duration_sec=1.0)
            return refused(TextRequest(r.text), f"engine error: {type(e).__name__}: {e}")

    def _fill_interjection(self, reply: Reply, refusal: str):
        response = self._Interject.Response()
        error = reply.error
        if not reply.success and refusal and not error.startswith(refusal):
            error = f"{refusal} (request ended: {error})"
        plan, speech = split_plan_and_say(reply.text) if reply.success else ("", "")
        if reply.success and self.engine.language_state(self.robot)["plan_frame"] != reply.frame_index:
            # The robot's task changed while the reply was decoded: the engine did not apply a plan made for the
            # task before, so none is reported as the robot's plan (the raw reply is still there).
            plan, speech = "", ""
            error = "the robot's task changed while the interjection was answered: its plan was not applied"
        response.success, response.plan, response.speech, response.reply = reply.success, plan, speech, reply.text
        response.error, response.frame_index = error, max(reply.frame_index, 0)
        response.frame_stamp = ros_time(reply.frame_stamp)
        response.latency_s, response.finish_reason = reply.latency_s, reply.finish_reason
        if not reply.success:
            self.get_logger().warning(f"interjection failed ({reply.finish_reason}): {error}",
                                      throttle_duration_sec=1.0)
        return response

    # ------------------------------------------------------------------ language topics
    def _publish_language(self) -> None:
        """Services executor: every update the engine made for this robot, in order, on its kind's topic."""
        for update in self.language.take():
            msg = self._LanguageUpdate(robot=update.robot, frame_index=max(update.frame_index, 0), text=update.text)
            msg.header.stamp = ros_time(update.stamp)
            self.language_pubs[update.kind].publish(msg)
            self.counts["language_published"] += 1

    def _send(self, sender, response, header) -> None:
        """Every service response goes out here (from a _DeferredResponse): never on a destroyed service."""
        try:
            with self._send_lock:
                if self._destroyed:
                    self.lost += 1
                    self.get_logger().error("a reply came after the service was destroyed: not sent")
                else:
                    sender(response, header)
        except RCLError as e:         # the client went away
            self.get_logger().warning(f"reply not sent: {e}", throttle_duration_sec=1.0)
        finally:
            with self._idle:
                self._unsent -= 1
                self._idle.notify_all()

    # ------------------------------------------------------------------ going away
    def close(self, reason: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Before the node is destroyed, while the executors still spin (the engine already stopped, so
        every engine request has its reply): new calls refused with `reason`, goals rejected; wait until
        every call taken has its response sent and every accepted goal its result. Then the results are
        handed to the clients that asked for them (executor tasks, see _results_handed_out)."""
        self.refusal = self.stopping = reason
        deadline = time.monotonic() + timeout_s
        with self._idle:
            # A send notifies; a goal ends inside rclpy (no notification): looked at every 20 ms.
            while not (self._unsent == 0 and self._goals_done()) and time.monotonic() < deadline:
                self._idle.wait(0.02)
        self._results_handed_out(max(deadline - time.monotonic(), 0.1))
        self._send_replies()           # what the executor could not send in time (all its threads busy)
        if self._unsent or not self._goals_done():
            self.get_logger().error(f"closing: {self._unsent} calls and {self._open_goals()} goals still "
                                    f"unanswered after {timeout_s:g} s")

    def _goals_done(self) -> bool:
        return self._open_goals() == 0

    def _open_goals(self) -> int:
        # rclpy keeps a result future per accepted goal until it expires, done once the goal has its result
        # (no public API says whether every goal has ended).
        return sum(not f.done() for f in list(self.action_server._result_futures.values()))

    def _results_handed_out(self, timeout_s: float) -> None:
        """A finished goal's result is sent to the clients that asked for it by executor tasks, created when
        the goal ends; a task created now runs after them (tasks are dispatched in creation order)."""
        executor = self.executor
        if executor is None:
            return
        ran = threading.Event()
        executor.create_task(ran.set)
        executor.wake()
        ran.wait(timeout_s)

    def destroy_node(self):
        """Refuse the calls still waiting in the middleware (the node is off its executor by now), then
        destroy: a later response is counted as lost instead of raising InvalidHandle."""
        reason = self.stopping or "conversation service destroyed"
        with self._send_lock:
            self._destroyed = True
            for deferred, count in ((self.service, "requests"), (self.interject_service, "interjections")):
                service = deferred.service
                while True:
                    with service.handle:
                        taken = service.handle.service_take_request(service.srv_type.Request)
                    if taken is None:
                        break
                    request, header = taken
                    if request is None:
                        break
                    self.counts[count] += 1
                    response = service.srv_type.Response(success=False, error=reason, finish_reason="refused")
                    try:
                        deferred.send_raw(response, header)
                    except RCLError:
                        pass
            return super().destroy_node()

    # ------------------------------------------------------------------ streaming action
    def _on_goal(self, goal) -> GoalResponse:
        """An early refusal only: the slot is taken when the goal executes. rclpy drops an accepted goal
        without executing it when its response cannot be sent (client gone); a slot taken here leaked.
        While the node goes away, goals are rejected (an accepted goal would need a result)."""
        if self.stopping:
            self.counts["streams_rejected"] += 1
            return GoalResponse.REJECT
        with self._streams_lock:
            full = self._stream_slots >= self.p["max_streams"]
        return GoalResponse.REJECT if full and self._refuse_stream() else GoalResponse.ACCEPT

    def _refuse_stream(self) -> str:
        self.counts["streams_rejected"] += 1
        error = f"busy: {self._stream_slots} streams already active (max_streams={self.p['max_streams']})"
        self.get_logger().warning(f"streaming goal rejected: {error}", throttle_duration_sec=1.0)
        return error

    def _on_cancel(self, goal_handle) -> CancelResponse:
        with self._streams_lock:
            handle = self._streams.get(bytes(goal_handle.goal_id.uuid))
        if handle is not None:
            handle.cancel()
        return CancelResponse.ACCEPT

    def _execute_stream(self, goal_handle):
        with self._streams_lock:
            full = self._stream_slots >= self.p["max_streams"]
            self._stream_slots += not full
        if full:  # accepted together with others while the last slots filled
            goal_handle.abort()
            return self._ConverseAction.Result(success=False, error=self._refuse_stream(), finish_reason="refused")
        key = bytes(goal_handle.goal_id.uuid)
        try:
            handle = self._submit(goal_handle.request)
            with self._streams_lock:
                self._streams[key] = handle
            self.counts["streams"] += 1
            reply = self._stream(goal_handle, handle)
        finally:
            with self._streams_lock:
                self._streams.pop(key, None)
                self._stream_slots -= 1
        self._record(goal_handle.request, reply)
        result = self._fill(self._ConverseAction.Result(), reply, self.refusal)
        if reply.finish_reason == "cancelled" and goal_handle.is_cancel_requested:
            goal_handle.canceled()
        elif reply.success:
            goal_handle.succeed()
        else:
            goal_handle.abort()
        return result

    def _stream(self, goal_handle, handle) -> Reply:
        """Feedback for every partial reply; the engine request is cancelled on any way out but its end."""
        # The wait is only a safety net behind the engine's own timeout: finite whatever the request says
        # (NaN, inf or 1e300 would make the wait raise instead of time out).
        timeout_s = float(goal_handle.request.timeout_s)
        if not 0 < timeout_s <= MAX_STREAM_WAIT_S:
            timeout_s = self.p["default_timeout_s"]
        try:
            for partial in handle.partials(timeout=timeout_s + 5.0):
                goal_handle.publish_feedback(
                    self._ConverseAction.Feedback(partial_reply=partial.text, tokens=partial.tokens))
                if goal_handle.is_cancel_requested:
                    handle.cancel()
        except TimeoutError:
            handle.cancel()
        except BaseException:
            handle.cancel()
            raise
        return handle.result(timeout=10.0)

    # ------------------------------------------------------------------ memory
    def _publish_captions(self) -> None:
        while True:
            try:
                c: Caption = self._captions.get_nowait()
            except queue.Empty:
                return
            msg = self._CaptionMsg(frame_index=c.frame_index, prompt=c.prompt, text=c.text)
            msg.header.stamp = ros_time(c.stamp)
            self.memory_pub.publish(msg)

    def diagnostics(self) -> list[DiagnosticStatus]:
        level = DiagnosticStatus.OK
        message = "ready"
        mine, config = self.engine.scheduler.waiting_of(self.robot), self.engine.config
        if mine >= config.max_queued_per_owner or self.engine.queued_requests >= config.max_queued_requests:
            level, message = DiagnosticStatus.WARN, "request queue full: new requests are refused as busy"
        values = dict(self.counts, active=self.engine.active_requests, queued=self.engine.queued_requests,
                      queued_for_this_robot=mine,
                      active_streams=self._stream_slots,
                      captions=sum(c.robot == self.robot for c in self.engine.captions()))
        return [status(status_name("conversation", self.robot), level, message, values)]
