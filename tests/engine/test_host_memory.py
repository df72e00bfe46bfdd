"""Host memory left free by compiling goes back to the OS (gacli.engine.host_memory)."""

import ctypes

import keras
import pytest

import gacli
from gacli.engine import host_memory
from gacli.runner.reporting.run_logs import host_memory_bytes
from helpers import make_data, mlp_layers


def test_freed_blocks_between_live_ones_are_given_back():
    """100 MB of 1 KB blocks, every 64th kept: the freed ones cannot merge into the heap's top,
    so glibc keeps their pages resident until a trim returns them."""
    if host_memory._malloc_trim() is None:
        pytest.skip("the C library has no malloc_trim (not glibc)")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(1024) for _ in range(100_000)]
    for block in blocks:
        ctypes.memset(block, 1, 1024)
    kept = blocks[::64]
    for index, block in enumerate(blocks):
        if index % 64:
            libc.free(block)
    held = host_memory_bytes()[0]
    assert host_memory.release_free_memory()
    released = held - host_memory_bytes()[0]
    for block in kept:
        libc.free(block)
    assert released > 50 * 2**20, f"only {released / 2**20:.1f} MiB released"


def test_fit_releases_after_the_first_calls_and_at_epoch_ends(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "release_free_memory", lambda: calls.append(1) or True)
    inputs, outputs = mlp_layers(0)
    model = gacli.GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = make_data(64)
    model.fit(x, y, batch_size=8, epochs=3, validation_data=make_data(16, seed=1), verbose=0)
    # After the first training call and the first validation call (the compiles), and at each
    # of the 3 epoch ends.
    assert len(calls) == 2 + 3
