"""The demo's simulated world: a MuJoCo reach scene (scene.py), its scripted expert (expert.py) and the
scene questions with their ground-truth answers (questions.py)."""
