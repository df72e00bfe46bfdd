"""A user's own project, as ``ga-train model._target_=user_project.nets.Net`` imports it: its
models (nets), data (data) and callbacks (hooks). tests/runner/builders/test_targets.py runs
ga-train on it with
``tests/`` on PYTHONPATH, as a user's package would be installed or on their path."""
