"""Recording a run as ROS 2 MCAP (bag.py, recorder.py) and replaying it through the engine (replay.py)."""
