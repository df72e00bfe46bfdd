"""``ga-train``: the typed config, the data, models and optimizers it builds, and the
:class:`~gacli.runner.train.Run` that owns one training job. It uses the engine as a library
user would.
"""
