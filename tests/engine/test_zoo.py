"""Models nobody here wrote, through ``wrap_model``, against their own big batch.

Small variants of real architectures: a ``keras.applications`` network with batch norm, a
two-output model with dict inputs and ``loss_weights``, and (with the ``hub`` extra installed)
KerasHub backbones built from a config, no weights downloaded. Where the docs promise the big
batch's weights the test asserts E1's tolerance; where no accumulation can give them (batch norm
in training mode) it asserts the warning and the result of the remedy the warning names first.
"""

import warnings

import keras
import numpy as np
import pytest

import gacli
from helpers import record, weights_difference

pytestmark = pytest.mark.slow

MICRO, K, WINDOWS = 4, 2, 3


def train_both(make_model, x, y, compile_options, sample_weight=None):
    """(accumulated model, big-batch model, the warnings wrap and compile gave): one epoch of
    WINDOWS windows, SGD, the same initial weights."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = gacli.wrap_model(make_model(), accum_steps=K)
        wrapped.compile(optimizer=keras.optimizers.SGD(0.05), **compile_options)
    wrapped.fit(
        x, y, sample_weight=sample_weight, batch_size=MICRO, epochs=1, shuffle=False, verbose=0
    )
    big = make_model()
    big.compile(optimizer=keras.optimizers.SGD(0.05), **compile_options)
    big.fit(
        x, y, sample_weight=sample_weight, batch_size=MICRO * K, epochs=1, shuffle=False, verbose=0
    )
    assert int(wrapped.optimizer_step.numpy()) == WINDOWS
    return wrapped, big, [w for w in caught if issubclass(w.category, gacli.BatchNormWarning)]


def mobilenet(policy=None):
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=10, dropout_rate=0.0, minimalistic=True
    )
    return gacli.apply_batchnorm_policy(model, policy) if policy else model


def test_a_keras_application_with_batch_norm_warns_and_freeze_gives_the_big_batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(MICRO * K * WINDOWS, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, MICRO * K * WINDOWS)
    options = dict(loss=keras.losses.SparseCategoricalCrossentropy())
    wrapped, big, warned = train_both(mobilenet, x, y, options)
    assert len(warned) == 1 and "'freeze'" in str(warned[0].message)
    kept = record(weights_difference(wrapped.get_weights(), big.get_weights()), "zoo bn keep")
    assert kept > 1e-4  # per-micro-batch statistics: not the big batch, as the warning says

    wrapped, big, warned = train_both(lambda: mobilenet("freeze"), x, y, options)
    assert warned == []
    frozen = weights_difference(wrapped.get_weights(), big.get_weights())
    assert record(frozen, "zoo bn freeze") <= 1e-6


def two_output_model():
    keras.utils.set_random_seed(0)
    image = keras.Input((6,), name="image")
    meta = keras.Input((3,), name="meta")
    hidden = keras.layers.Dense(8, activation="tanh")(
        keras.layers.Concatenate()([keras.layers.Dense(8)(image), meta])
    )
    label = keras.layers.Dense(3, name="label")(hidden)
    score = keras.layers.Dense(1, name="score")(hidden)
    return keras.Model({"image": image, "meta": meta}, {"label": label, "score": score})


def test_two_outputs_dict_inputs_loss_weights_and_sample_weights_give_the_big_batch():
    rng = np.random.default_rng(0)
    n = MICRO * K * WINDOWS
    x = {"image": rng.normal(size=(n, 6)), "meta": rng.normal(size=(n, 3))}
    y = {"label": rng.integers(0, 3, n), "score": rng.normal(size=(n, 1))}
    options = dict(
        loss={
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "score": "mse",
        },
        loss_weights={"label": 0.3, "score": 2.0},
    )
    wrapped, big, warned = train_both(two_output_model, x, y, options)
    assert warned == []
    assert record(weights_difference(wrapped.get_weights(), big.get_weights())) <= 1e-6
    weights = rng.uniform(0.5, 1.5, n)
    wrapped, big, _ = train_both(two_output_model, x, y, options, sample_weight=weights)
    assert record(weights_difference(wrapped.get_weights(), big.get_weights())) <= 1e-6


def tiny_tokens(n=MICRO * K * WINDOWS, length=12, vocabulary=64):
    """Token ids with real padding: each row a length of 4 to ``length`` tokens, zeros after."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocabulary, (n, length))
    mask = np.arange(length)[None] < rng.integers(4, length + 1, n)[:, None]
    return tokens * mask, mask


def tiny_backbone(name, num_layers=1, dropout=0.0):
    """A KerasHub backbone class ``name`` built from a tiny config (without dropout unless
    asked)."""
    hub = pytest.importorskip("keras_hub", reason="the hub extra: pip install 'gacli[hub]'")
    keras.utils.set_random_seed(0)
    return hub, getattr(hub.models, name)(
        vocabulary_size=64,
        num_layers=num_layers,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=12,
        dropout=dropout,
    )


def gpt2_causal_lm(num_layers=1, dropout=0.0):
    hub, backbone = tiny_backbone("GPT2Backbone", num_layers, dropout)
    return hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def bert_classifier():
    hub, backbone = tiny_backbone("BertBackbone")
    return hub.models.BertTextClassifier(
        backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0
    )


def test_kerashub_causal_lm_with_its_padding_mask_as_sample_weight_gives_the_big_batch():
    """A GPT-2 backbone from a config: next-token loss weighted by the padding mask."""
    tokens, mask = tiny_tokens()
    x = {"token_ids": tokens, "padding_mask": mask}
    y = np.roll(tokens, -1, axis=1)
    options = dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    wrapped, big, warned = train_both(
        gpt2_causal_lm, x, y, options, sample_weight=mask.astype("float32")
    )
    assert warned == []
    assert record(weights_difference(wrapped.get_weights(), big.get_weights())) <= 1e-6


def test_kerashub_text_classifier_gives_the_big_batch_and_passes_the_check():
    tokens, mask = tiny_tokens()
    x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": mask}
    y = np.random.default_rng(1).integers(0, 3, len(tokens))
    options = dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    wrapped, big, warned = train_both(bert_classifier, x, y, options)
    assert warned == []
    assert record(weights_difference(wrapped.get_weights(), big.get_weights())) <= 1e-6
    model = gacli.wrap_model(bert_classifier(), accum_steps=K)
    model.compile(optimizer=keras.optimizers.SGD(0.05), **options)
    result = gacli.check_equivalence(model, x, y, micro_batch_size=MICRO)
    assert result.passed, result


def test_m1_kerashub_transformer_layers_recomputed_train_the_same_weights(monkeypatch):
    """Contract M1 on a KerasHub task model: a GPT-2 causal LM (two transformer layers, dropout
    0.1) with each transformer layer recomputed by name, its padding mask a keyword argument of
    the layer's call, trained by the model wrapper on padded tokens: the same weights as without
    recomputation (the recomputed pass draws the first pass's dropout masks)."""
    from gacli.engine import remat as recomputation

    blocks = []
    block = recomputation.recompute_block
    monkeypatch.setattr(
        recomputation,
        "recompute_block",
        lambda function, tensors, layers, training=None: (
            blocks.append(layers[0].name) or block(function, tensors, layers, training)
        ),
    )
    tokens, mask = tiny_tokens()
    x = {"token_ids": tokens, "padding_mask": mask}
    y = np.roll(tokens, -1, axis=1)
    trained = []
    for remat in (None, ["transformer_layer_0", "transformer_layer_1"]):
        model = gacli.wrap_model(gpt2_causal_lm(2, dropout=0.1), accum_steps=K, remat=remat)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(
            x, y, sample_weight=mask.astype("float32"), batch_size=MICRO, shuffle=False, verbose=0
        )
        trained.append(model.get_weights())
    assert set(blocks) == {"transformer_layer_0", "transformer_layer_1"}  # traced recomputed
    assert record(weights_difference(*trained)) <= 1e-6
