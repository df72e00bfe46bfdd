"""One training run: the ``Run`` that owns a job from plan to result (run), its checkpoints, data
order and signals (run_state), ``resume=`` (resume), the budget of skipped windows (skip_budget)
and the out-of-memory fault tests inject (fault_injection).
"""
