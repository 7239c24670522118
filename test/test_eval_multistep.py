"""The multi-step evaluation's two ways of serving the hierarchical arm (oxygen_ros/eval_multistep.py): the
model's reference path (`JointReference`, one frame at a time) and the engine (`EnginePlanner`) read the joint
recipe's prompt in the same attention blocks (pi052.joint_tokens), so the same frame, task and noise give the
same actions. Tolerance 2e-5 (float32, as test_hierarchy_engine's JOINT_TOL; measured 0 on the CPU; the
earlier layout, "Assistant: {task}" EOS "\\n" all causal after "User: ...;\\n", misses by 5.2e-3-1.4e-2, and
EOS blind to the newline by 6.1e-5-1.5e-4)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oxygen_ros.eval import demo_model_config
from oxygen_ros.eval_multistep import EnginePlanner, JointReference
from oxygen_ros.robot.configs import demo_checkpoint

TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def demo():
    from oxygen_ros.engine.factory import build_model

    checkpoint = demo_checkpoint()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_model(demo_model_config(checkpoint), str(checkpoint)), checkpoint
    torch.set_num_threads(threads)


@pytest.mark.parametrize("task", ["touch the blue cube, then the red one", "3 cubes, left to right"],
                         ids=["space", "lone-space"])
def test_the_reference_path_reads_the_engines_blocks(demo, task):
    """The first frame: no subtask yet, so the engine's actions read the task in the subtask's place, as the
    task-only arm does. A task starting with a digit has no leading-space piece: the lone space piece joins
    the first block (the engine prefills the frame with that block, and its actions read it: no prefill of
    their own), and the reference path must put it there too."""
    model, checkpoint = demo
    rng = np.random.default_rng(7)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    state = rng.uniform(-1, 1, model.cfg.action_dim)
    noise = rng.standard_normal((model.cfg.action_horizon, model.cfg.action_dim)).astype(np.float32)
    engine = EnginePlanner(model, checkpoint)
    served = engine.plan(image, state, task, noise)
    assert served.subtask == task
    assert engine.engine.stats.counter("joint_own_prefill") == 0
    reference = JointReference(model, checkpoint, hierarchy=False).plan(image, state, task, noise)
    diff = float(np.abs(served.actions - reference.actions).max())
    assert diff <= TOLERANCE, f"the reference path's actions differ from the engine's by {diff:.2e}"
