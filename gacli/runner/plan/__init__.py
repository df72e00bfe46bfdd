"""The batch plan and what follows from it: the batch arithmetic (batch), steps and windows per
epoch (steps), accumulation schedules (accum_schedule), ``micro_batch_size=auto`` and
``batch_plan.json`` (auto_micro_batch), ``oom=recover`` (out_of_memory).
"""
