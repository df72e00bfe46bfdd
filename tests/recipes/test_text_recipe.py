"""The text_lm recipe's pieces (recipes/text_lm.py): the help-topics corpus as padded byte
sequences, the causal transformer, the perplexity metric, and the point of the recipe: with
padding masks as sample weights, k micro-batches under loss_normalization="window_weights" give
the big batch's weights. The recipe's run and its promised perplexity:
tests/recipes/test_recipes.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gacli
from gacli.recipes.text_lm import (
    PADDING_ID,
    VOCABULARY_SIZE,
    Perplexity,
    causal_lm,
    pydoc_topics,
    topic_paragraphs,
)
from helpers import max_weight_difference

SEQUENCE, MICRO, K = 16, 4, 3


def test_pydoc_topics_is_next_byte_prediction_over_every_paragraph():
    paragraphs = topic_paragraphs()
    (x, y, w), (x_val, y_val, w_val) = pydoc_topics(sequence_length=SEQUENCE, seed=0)
    assert x.shape[1] == SEQUENCE and x.dtype == y.dtype == np.int32 and w.dtype == np.float32
    # Every byte but each paragraph's first is a target exactly once, in one set or the other.
    assert int(w.sum() + w_val.sum()) == sum(len(p) for p in paragraphs) - len(paragraphs)
    for tokens, targets, mask in ((x, y, w), (x_val, y_val, w_val)):
        real = mask.astype(bool)
        assert np.all(targets[:, :-1][real[:, 1:]] == tokens[:, 1:][real[:, 1:]])
        assert np.all(targets[~real] == PADDING_ID) and np.all(tokens[~real] == PADDING_ID)
        assert np.all(targets[real] < 256) and np.all(mask.sum(axis=1) >= 1)
        # Padding only at the end: each mask is 1s, then 0s.
        assert np.all(np.diff(mask, axis=1) <= 0)
    # A tenth of the paragraphs held out, by a seeded choice: the same seed, the same split.
    assert 0.07 < w_val.sum() / (w.sum() + w_val.sum()) < 0.15
    again = pydoc_topics(sequence_length=SEQUENCE, seed=0)[1][0]
    other = pydoc_topics(sequence_length=SEQUENCE, seed=1)[1][0]
    assert np.array_equal(again, x_val) and not np.array_equal(other[: len(x_val)], x_val)


def test_causal_lm_predicts_each_position_from_the_ones_before_it():
    model = causal_lm(sequence_length=SEQUENCE, width=8, depth=1, heads=2)
    assert model.output_shape == (None, SEQUENCE, VOCABULARY_SIZE)
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, SEQUENCE)).astype("int32")
    changed = tokens.copy()
    changed[:, 10:] = PADDING_ID
    before, after = model.predict(tokens, verbose=0), model.predict(changed, verbose=0)
    assert np.max(np.abs(before[:, :10] - after[:, :10])) <= 1e-6
    assert np.max(np.abs(before[:, 10:] - after[:, 10:])) > 1e-3


def test_perplexity_counts_real_tokens_only_over_the_whole_set():
    (x, y, w), _ = pydoc_topics(sequence_length=SEQUENCE)
    x, y, w = x[:64], y[:64], w[:64]
    assert w.mean() < 0.99  # some padding, so counting it would show
    model = causal_lm(sequence_length=SEQUENCE, width=8, depth=1, heads=2)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logits = model.predict(x, verbose=0)
    losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True).numpy()
    per_token = np.exp(np.sum(losses * w) / np.sum(w))
    metric = Perplexity()
    for part in np.array_split(np.arange(64), [10, 40]):  # uneven batches
        metric.update_state(y[part], logits[part])
    assert float(metric.result()) == pytest.approx(per_token, rel=1e-5)
    restored = Perplexity.from_config(metric.get_config())
    assert restored.padding_id == PADDING_ID and restored.name == "perplexity"


def ragged_windows():
    """Two windows of K micro-batches of MICRO sequences: each window has a micro-batch of full
    sequences, one of mixed lengths and one of sequences of a few real tokens."""
    (x, y, w), _ = pydoc_topics(sequence_length=SEQUENCE)
    tokens = w.sum(axis=1)
    full = np.flatnonzero(tokens == SEQUENCE)[: 2 * MICRO]
    mixed = np.flatnonzero((tokens > 4) & (tokens < SEQUENCE))[: 2 * MICRO]
    short = np.flatnonzero(tokens <= 4)[: 2 * MICRO]
    # (3 kinds, 2 windows, MICRO) -> window by window, each full, mixed, short.
    order = np.stack([part.reshape(2, MICRO) for part in (full, mixed, short)], axis=1).ravel()
    return x[order], y[order], w[order]


# SGD with momentum, not the recipe's Adam: the attention's key bias has no true gradient (a shift
# shared by all keys leaves the softmax as it is), and Adam turns its float32 rounding noise
# (~1e-9) into steps of ~1e-5 that differ between any two summation orders, the big batch's too.
def make_optimizer():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def big_batch_reference(x, y, w):
    """One update per window on the window's loss (its token losses summed over its real
    tokens, divided by their number), the embedding's gradient made dense: each repeated row's
    occurrences summed, the reference of docs/contract.md's sparse-gradient row."""
    model = tiny_causal_lm()
    optimizer = make_optimizer()
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
    for start in range(0, len(x), MICRO * K):
        part = slice(start, start + MICRO * K)
        with tf.GradientTape() as tape:
            value = loss(y[part], model(x[part], training=True), sample_weight=w[part])
        gradients = tape.gradient(value, model.trainable_variables)
        dense = [tf.convert_to_tensor(gradient) for gradient in gradients]
        optimizer.apply_gradients(zip(dense, model.trainable_variables))
    return model


def tiny_causal_lm():
    keras.utils.set_random_seed(0)
    return causal_lm(sequence_length=SEQUENCE, width=8, depth=1, heads=2)


# (loss_normalization, the compiled loss's reduction, whether it gives the window's token mean)
NORMALISATIONS = [
    ("window_weights", "sum_over_batch_size", True),
    # Keras' default divides by every position, padding too: each update shrinks with its
    # window's padding.
    ("batch", "sum_over_batch_size", False),
    # A mean over each micro-batch's real tokens: the tokens of a mostly padded micro-batch weigh
    # more than those of a full one.
    ("batch", "mean_with_sample_weight", False),
]


@pytest.mark.exactness
@pytest.mark.parametrize("loss_normalization, reduction, exact", NORMALISATIONS)
def test_ragged_padding_masks_window_weights_equal_the_big_batch(
    loss_normalization, reduction, exact
):
    x, y, w = ragged_windows()
    tokens = w.reshape(-1, MICRO, SEQUENCE).sum(axis=(1, 2))
    assert tokens.max() >= 4 * tokens.min()  # micro-batches that weigh very differently
    reference = big_batch_reference(x, y, w)

    model = gacli.wrap_model(tiny_causal_lm(), accum_steps=K, loss_normalization=loss_normalization)
    model.compile(
        optimizer=make_optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
    )
    model.fit(x, y, sample_weight=w, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer_step.numpy()) == 2
    difference = max_weight_difference(model, reference)
    if exact:
        assert difference <= 1e-6  # momentum's tolerance in tests/helpers.py's OPTIMIZERS
    else:
        assert difference > 1e-3
