"""Fixtures and hooks only; what tests share lives in ``helpers``.

Every exactness test compares an accumulated run with a plain Keras run that sees the same samples
as one batch per window, starting from the same weights (``helpers.big_batch_reference``).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from helpers import MEASURED, OPTIMIZERS, current_test  # noqa: E402


@pytest.fixture(autouse=True)
def _name_measurements(request):
    current_test["id"] = request.node.nodeid.split("::", 1)[-1]
    yield
    current_test["id"] = None


def pytest_terminal_summary(terminalreporter):
    if not MEASURED:
        return
    terminalreporter.section("measured max abs weight differences")
    for test_id, values in sorted(MEASURED.items()):
        terminalreporter.write_line(f"{test_id:<72} {', '.join(f'{v:.2e}' for v in values)}")


@pytest.fixture(params=sorted(OPTIMIZERS))
def optimizer_case(request):
    """(name, optimizer factory, tolerance) for every optimizer of contract row E1."""
    make, tolerance = OPTIMIZERS[request.param]
    return request.param, make, tolerance
