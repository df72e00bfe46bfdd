"""Jobs that check instead of train: ``probe=batch`` (batch_probe), ``check=equivalence``
(equivalence_check), the GPU self-check (selfcheck).
"""
