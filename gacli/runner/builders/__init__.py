"""Building a job from its config: the model (model), the data (data), the optimizer (optimizer),
each by its ``_target_`` (targets), and the compiled, wrapped job (job).
"""
