"""Fixtures and hooks only; what tests share lives in ``helpers``.

Every exactness test compares an accumulated run with a plain Keras run that sees the same samples
as one batch per window, starting from the same weights (``helpers.big_batch_reference``).
"""

import gc
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from helpers import IN_PROCESS_ONLY, MEASURED, OPTIMIZERS, current_test  # noqa: E402

# The fast lane (docs/contributing.md): the tests that run in this process, without the slow,
# distributed, SLURM and GPU ones, and skipping each that would start ga-train or ga-report.
IN_PROCESS_LANE = "not slow and not distributed and not slurm and not gpu"


def pytest_addoption(parser):
    parser.addoption(
        "--in-process",
        action="store_true",
        help="the fast lane: tests in this process only (no ga-train process, no slow, "
        "distributed, SLURM or GPU test)",
    )


def pytest_configure(config):
    if config.getoption("--in-process"):
        IN_PROCESS_ONLY["on"] = True
        chosen = config.option.markexpr
        config.option.markexpr = f"({chosen}) and {IN_PROCESS_LANE}" if chosen else IN_PROCESS_LANE
        _skip_multi_epoch_runs()


def _skip_multi_epoch_runs():
    """In the fast lane, a ga-train job of more than one epoch run in this process (train(cfg))
    is skipped: the full suite runs it."""
    from gacli.runner.training import run

    train = run.train

    def one_epoch_only(cfg, *args, **kwargs):
        if cfg.epochs > 1:
            pytest.skip(f"trains {cfg.epochs} epochs: not in the in-process lane (--in-process)")
        return train(cfg, *args, **kwargs)

    run.train = one_epoch_only


def pytest_collection_finish(session):
    """Everything imported so far (TensorFlow, Keras, Hydra, the test modules) lives as long as
    the process: frozen, Python's collector stops walking it again in each full collection, of
    which a session has many (every train() starts with one, gacli.runner.reporting.memory)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def _no_terminal_size_from_the_runner():
    """The command lines size their tables by COLUMNS where it is set, and the tests read whole
    lines of them: every test runs without the COLUMNS and LINES of whatever started pytest
    (pytest-xdist's workers have 80 and 24; some shells export them). A test that wants a width
    sets it itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("COLUMNS", raising=False)
        patch.delenv("LINES", raising=False)
        yield


@pytest.fixture(autouse=True)
def _name_measurements(request):
    current_test["id"] = request.node.nodeid.split("::", 1)[-1]
    yield
    current_test["id"] = None


def pytest_sessionfinish(session):
    # Under pytest-xdist each worker hands its measurements to the controller, which prints them.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["gacli_measured"] = json.dumps(MEASURED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    measured = json.loads(getattr(node, "workeroutput", {}).get("gacli_measured", "{}"))
    for test_id, values in measured.items():
        MEASURED.setdefault(test_id, []).extend(values)


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
