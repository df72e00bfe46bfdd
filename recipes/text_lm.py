"""Byte-level language modelling on a corpus that every Python ships, for ``recipes/text_lm.yaml``.

The corpus is the text of ``pydoc_data.topics``: the pages ``help("assert")``, ``help("with")``
and the like print (0.47 MB on Python 3.11; other Python versions ship other text). Each
paragraph of a topic is one document, cut into sequences of ``sequence_length`` byte tokens and
padded at the end, so that micro-batches hold different numbers of real tokens: the case where
``loss_normalization="window_weights"`` makes ``k`` micro-batches the big batch's mean over its
real tokens (docs/cli.md, "A language model: padded sequences").

``pydoc_topics`` (a dataset) and ``causal_lm`` (a model) are what the recipe names by
``_target_``; ``Perplexity`` is the metric that reads the result per token.
"""

import keras
import numpy as np
from keras import ops

# Byte values are 0..255; padding takes the next id, so no byte is mistaken for it.
PADDING_ID = 256
VOCABULARY_SIZE = 257


def topic_paragraphs():
    """Every non-blank paragraph of every help topic, as UTF-8 bytes, topics in sorted order."""
    from pydoc_data.topics import topics

    return [
        paragraph
        for name in sorted(topics)
        for paragraph in topics[name].encode("utf-8").split(b"\n\n")
        if paragraph.strip()
    ]


def _sequences(paragraphs, sequence_length):
    """(tokens, targets, mask) of the paragraphs cut into sequences of ``sequence_length``: each
    target is the next byte, and the mask is 1 where a target is a real byte, 0 on padding."""
    rows = []
    for paragraph in paragraphs:
        data = np.frombuffer(paragraph, dtype=np.uint8).astype("int32")
        # Piece i covers bytes [i*L, i*L + L]: every byte but a paragraph's first is a target once.
        for start in range(0, len(data) - 1, sequence_length):
            rows.append(data[start : start + sequence_length + 1])
    tokens = np.full((len(rows), sequence_length), PADDING_ID, dtype="int32")
    targets = np.full((len(rows), sequence_length), PADDING_ID, dtype="int32")
    mask = np.zeros((len(rows), sequence_length), dtype="float32")
    for row, piece in enumerate(rows):
        length = len(piece) - 1
        tokens[row, :length] = piece[:-1]
        targets[row, :length] = piece[1:]
        mask[row, :length] = 1.0
    return tokens, targets, mask


def pydoc_topics(sequence_length=128, validation_split=0.1, seed=0):
    """The help topics as next-byte prediction: ``((x, y, w), (x, y, w))`` for training and
    validation, NumPy arrays with one row per sequence. ``x``: int32 byte tokens, ``y``: ``x``
    shifted by one, ``w``: float32, 1 for a real target and 0 for padding (the sample weight that
    keeps padding out of the loss).

    Whole paragraphs are held out: a seeded permutation puts ``validation_split`` of them (by
    count) in validation, so no sequence shares a paragraph with one of the other set.

    Example:
        >>> (x, y, w), (x_val, y_val, w_val) = pydoc_topics(sequence_length=64)
        >>> int(w.sum())  # target bytes in training
    """
    if not 0 <= validation_split < 1:
        raise ValueError(f"validation_split={validation_split!r} must be in [0, 1), e.g. 0.1.")
    paragraphs = topic_paragraphs()
    order = np.random.default_rng(seed).permutation(len(paragraphs))
    held_out = set(order[: round(validation_split * len(paragraphs))].tolist())
    train = [p for index, p in enumerate(paragraphs) if index not in held_out]
    validation = [p for index, p in enumerate(paragraphs) if index in held_out]
    return _sequences(train, sequence_length), _sequences(validation, sequence_length)


@keras.saving.register_keras_serializable(package="gacli")
class LearnedPositions(keras.layers.Layer):
    """Adds a learned vector per position to a ``(batch, sequence, width)`` input.

    Example:
        >>> x = LearnedPositions()(keras.layers.Embedding(257, 64)(tokens))
    """

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]), initializer=keras.initializers.RandomNormal(0.0, 0.02)
        )

    def call(self, inputs):
        return inputs + ops.cast(self.positions, inputs.dtype)


def _decoder_block(x, width, heads):
    """Pre-norm: causal self-attention, then a 4x-wide GELU MLP, each around a residual."""
    attended = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    attended = keras.layers.MultiHeadAttention(heads, width // heads)(
        attended, attended, use_causal_mask=True
    )
    x = keras.layers.Add()([x, attended])
    hidden = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    hidden = keras.layers.Dense(4 * width, activation="gelu")(hidden)
    return keras.layers.Add()([x, keras.layers.Dense(width)(hidden)])


def causal_lm(vocabulary_size=VOCABULARY_SIZE, sequence_length=128, width=64, depth=2, heads=4):
    """A small decoder-only transformer: token and learned position embeddings, ``depth``
    pre-norm blocks of causal self-attention, and next-token logits of shape
    ``(batch, sequence_length, vocabulary_size)``. Padding at the end of a sequence needs no
    attention mask: causal attention never lets a real token see the positions after it.

    Example:
        >>> model = causal_lm(sequence_length=64, width=32, depth=1, heads=2)
    """
    if width % heads:
        raise ValueError(f"width={width} must be a multiple of heads={heads}.")
    tokens = keras.Input((sequence_length,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocabulary_size, width)(tokens)
    x = LearnedPositions()(x)
    for _ in range(depth):
        x = _decoder_block(x, width, heads)
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    logits = keras.layers.Dense(vocabulary_size, name="logits", dtype="float32")(x)
    return keras.Model(tokens, logits, name="causal_lm")


@keras.saving.register_keras_serializable(package="gacli")
class Perplexity(keras.metrics.SparseCategoricalCrossentropy):
    """``exp`` of the mean cross-entropy per token over all the batches seen (the perplexity of
    the whole set, where ``exp(val_loss)`` would average per-batch means). Targets equal to
    ``padding_id`` are not counted, so it is right in ``compile(metrics=...)``, which Keras calls
    without sample weights, as well as in ``weighted_metrics=``, where each token also counts by
    its weight.

    Args:
        padding_id: the target id that is never counted (None: every target is).
        from_logits: whether the model gives logits rather than probabilities.

    Example:
        >>> model.compile(loss=..., metrics=[Perplexity()])  # logs perplexity, val_perplexity
    """

    def __init__(self, name="perplexity", dtype=None, padding_id=PADDING_ID, from_logits=True):
        super().__init__(name=name, dtype=dtype, from_logits=from_logits)
        self.padding_id = padding_id

    def update_state(self, y_true, y_pred, sample_weight=None):
        if self.padding_id is not None:
            real = ops.cast(ops.not_equal(y_true, self.padding_id), self.dtype)
            sample_weight = real if sample_weight is None else real * sample_weight
        return super().update_state(y_true, y_pred, sample_weight=sample_weight)

    def result(self):
        return ops.exp(super().result())

    def get_config(self):
        base = super().get_config()
        return {
            "name": base["name"],
            "dtype": base["dtype"],
            "padding_id": self.padding_id,
            "from_logits": base["from_logits"],
        }
