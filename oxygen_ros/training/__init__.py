"""Training the demo's small π0.5 from scratch on the CPU: rendered data (data.py), batches of prompts,
questions and action chunks (batches.py), differentiable attention over padded rows (attention.py) and
the training entry point (train.py)."""
