"""``ga-train``, in rooms by job: ``command/`` (the command line), ``config/`` (the schema and its
validation), ``plan/`` (the batch plan), ``builders/`` (model, data, optimizer), ``cluster/``
(strategies and SLURM), ``training/`` (the run, checkpoints, resume), ``reporting/``
(TensorBoard, CSV, MLflow, console) and ``tools/`` (the probe, the equivalence check, the
self-check). It uses the engine as a library user would. docs/engine.md lists its modules and
the job of each.
"""
