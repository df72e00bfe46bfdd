"""``ga-train``: the typed config, the data, models and optimizers it builds, and the
:class:`~gacli.runner.run.Run` that owns one training job. It uses the engine as a library
user would. docs/engine.md lists its modules and the job of each.
"""
