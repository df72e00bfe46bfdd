"""Contract row E3: window-level normalisation by the total sample weight (e.g. real tokens)."""

import keras
import numpy as np
import pytest

import gacli
from helpers import max_weight_difference

# Also run on the oldest supported TensorFlow and Keras (scripts/ci_oldest.sh).
pytestmark = pytest.mark.exactness

VOCABULARY, LENGTH, MICRO, K = 20, 12, 8, 3


def padded_sequences(num_samples=48, seed=0):
    """Token ids with padding; the first micro-batches are long, the last ones very short."""
    rng = np.random.default_rng(seed)
    lengths = np.sort(rng.integers(1, LENGTH + 1, size=num_samples))[::-1]
    lengths[-MICRO:] = 1  # a micro-batch of 8 tokens beside ones of ~90
    mask = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype("float32")
    x = rng.integers(1, VOCABULARY, size=(num_samples, LENGTH)) * mask.astype("int64")
    y = rng.integers(0, 3, size=(num_samples, LENGTH)) * mask.astype("int64")
    return x, y, mask


def tagger_layers(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 4)(inputs)
    return inputs, keras.layers.Dense(3)(hidden)


def token_mean_loss():
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )


def window_reference(x, y, mask, epochs):
    """Plain Keras: one step per window, loss = sum of token losses / tokens in the window."""
    model = keras.Model(*tagger_layers())
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=token_mean_loss())
    window = MICRO * K
    for _ in range(epochs):
        for start in range(0, len(x), window):
            part = slice(start, start + window)
            model.train_on_batch(x[part], y[part], sample_weight=mask[part])
    return model


@pytest.mark.parametrize("loss_normalization", ["window_weights", "batch"])
def test_e3_window_weights_normalise_by_the_tokens_of_the_whole_window(loss_normalization):
    x, y, mask = padded_sequences()
    tokens_per_micro_batch = mask.reshape(-1, MICRO, LENGTH).sum(axis=(1, 2))
    assert tokens_per_micro_batch.max() > 8 * tokens_per_micro_batch.min()
    reference = window_reference(x, y, mask, epochs=2)

    inputs, outputs = tagger_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=K, loss_normalization=loss_normalization, inputs=inputs, outputs=outputs
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, sample_weight=mask, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    difference = max_weight_difference(model, reference)
    if loss_normalization == "window_weights":
        assert difference <= 1e-6
    else:
        # Keras' own semantics (per-sample mean over padded positions) is a different update.
        assert difference > 1e-3


def test_e3_window_weights_needs_sample_weights():
    x, y, _ = padded_sequences()
    inputs, outputs = tagger_layers()
    model = gacli.GradientAccumulateModel(
        accum_steps=K, loss_normalization="window_weights", inputs=inputs, outputs=outputs
    )
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    with pytest.raises(ValueError, match="pass sample_weight="):
        model.fit(x, y, batch_size=MICRO, verbose=0)
