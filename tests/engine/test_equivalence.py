"""The equivalence self-check (contract Q1): ``gacli.check_equivalence`` and
``ga-train check=equivalence`` pass exactly when one accumulated window equals one big-batch
update, name the layers and the kind of cause when it does not, and leave the user's model,
optimizer and random state as they were."""

import json
import os
import random

import keras
import numpy as np
import pytest

import gacli
from gacli.engine.equivalence import EquivalenceInputError
from helpers import FEATURES, embedding_model, ga_train, make_data, record, run_dir_of, token_data


def mlp(extra=None, seed=0):
    """A small MLP; ``extra`` adds a layer after the hidden one (Dropout, BatchNormalization)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    if extra is not None:
        hidden = extra(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def compiled(model, optimizer=None, loss="mse"):
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss=loss)
    return model


X, Y = make_data(96)


def sgd_momentum():
    return keras.optimizers.SGD(0.1, momentum=0.9)  # momentum: optimizer state of its own


@pytest.mark.exactness
@pytest.mark.parametrize(
    "optimizer, tolerance",
    [
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1e-6),
        (lambda: keras.optimizers.Adam(0.01), 1e-5),
    ],
)
def test_q1_passes_on_an_exact_model_with_both_wrappers_and_wrap_model(optimizer, tolerance):
    results = [
        gacli.check_equivalence(
            compiled(mlp(), optimizer()), X, Y, accum_steps=4, micro_batch_size=16, wrapper=wrapper
        )
        for wrapper in ("model", "optimizer")
    ]
    # A model made with wrap_model, and a plain one compiled with the optimizer wrapper: each
    # is checked with the wrapper it uses and its own accum_steps.
    wrapped = gacli.wrap_model(mlp(), accum_steps=3)
    wrapped.compile(optimizer=optimizer(), loss="mse")
    plain = mlp()
    plain.compile(
        optimizer=gacli.GradientAccumulateOptimizer(optimizer(), accum_steps=2), loss="mse"
    )
    results += [gacli.check_equivalence(m, X, Y, micro_batch_size=16) for m in (wrapped, plain)]
    # A short last micro-batch (E2): 56 samples, the fourth micro-batch holds 8.
    results.append(
        gacli.check_equivalence(
            compiled(mlp(), optimizer()),
            X,
            Y,
            accum_steps=4,
            micro_batch_size=16,
            window_samples=56,
        )
    )
    assert [r.window["wrapper"] for r in results] == [
        "model",
        "optimizer",
        "model",
        "optimizer",
        "model",
    ]
    assert [r.window["accum_steps"] for r in results] == [4, 4, 3, 2, 4]
    for result in results:
        assert result.passed, str(result)
        assert result.tolerance == tolerance
        assert record(result.max_abs_diff) <= tolerance
        assert result.max_abs_diff > 0 or result.window["accum_steps"] == 1
        assert len(result.variables) == 4 and not result.causes
        assert "EQUIVALENT" in str(result) and "dense" in str(result)


@pytest.mark.exactness
def test_q1_passes_on_an_embedding_model_and_a_dataset():
    import tensorflow as tf

    x, y = token_data(64)
    model = compiled(embedding_model(), keras.optimizers.Adam(0.01))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    result = gacli.check_equivalence(model, dataset, accum_steps=4, micro_batch_size=16)
    assert result.passed, str(result)
    assert result.window["samples"] == 64
    assert record(result.max_abs_diff) <= 1e-5
    assert any(v.kind == "Embedding" for v in result.variables)


def test_q1_dropout_fails_names_it_and_the_rest_is_exact():
    model = compiled(mlp(lambda h: keras.layers.Dropout(0.3, name="my_dropout")(h)), sgd_momentum())
    result = gacli.check_equivalence(model, X, Y, accum_steps=4, micro_batch_size=16)
    assert not result.passed
    assert record(result.max_abs_diff) > 1e-4
    kinds = {cause.kind: cause for cause in result.causes}
    assert kinds["dropout and other random layers"].layers == ["my_dropout"]
    assert "within tolerance" in kinds["the rest, re-checked"].why
    assert "my_dropout" in str(result) and "NOT EQUIVALENT" in str(result)


def test_q1_batch_norm_fails_names_it_and_freeze_is_exact():
    def model():
        return compiled(
            mlp(lambda h: keras.layers.BatchNormalization(name="my_bn")(h)), sgd_momentum()
        )

    result = gacli.check_equivalence(model(), X, Y, accum_steps=4, micro_batch_size=16)
    assert not result.passed
    (cause, rest) = result.causes
    assert cause.kind == "batch normalisation" and cause.layers == ["my_bn"]
    assert "batchnorm=freeze" in cause.why and "within tolerance" in rest.why
    failing = {v.name for v in result.failing}
    assert {"my_bn/moving_mean", "my_bn/moving_variance"} <= failing
    frozen = gacli.check_equivalence(
        model(), X, Y, accum_steps=4, micro_batch_size=16, batchnorm="freeze"
    )
    assert frozen.passed, str(frozen)
    assert record(frozen.max_abs_diff) <= 1e-6


@pytest.mark.parametrize("optimizer", [keras.optimizers.SGD, keras.optimizers.Adam])
def test_q1_a_loss_divided_by_its_own_token_count_fails(optimizer):
    """The planted bug: a masked sequence loss divided by the tokens of its own call, so a
    micro-batch with few tokens weighs as much as one with many. (Adam's first update keeps
    little more than each gradient's sign; the window's gradient is compared too.)"""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6, FEATURES)).astype("float32")
    lengths = rng.integers(1, 7, size=64)
    mask = (np.arange(6)[None, :] < lengths[:, None]).astype("float32")
    y = np.concatenate([rng.normal(size=(64, 6, 1)), mask[..., None]], axis=-1).astype("float32")

    def per_call_token_mean(y_true, y_pred):
        target, tokens = y_true[..., :1], y_true[..., 1:]
        return keras.ops.sum(tokens * (y_pred - target) ** 2) / keras.ops.sum(tokens)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, FEATURES))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, "tanh")(inputs)))
    model.compile(optimizer=optimizer(0.01), loss=per_call_token_mean)
    result = gacli.check_equivalence(model, x, y, accum_steps=4, micro_batch_size=16)
    assert not result.passed
    largest = result.max_abs_diff if optimizer is keras.optimizers.SGD else result.max_gradient_diff
    assert record(largest) > 1e-4
    (cause,) = result.causes
    assert cause.kind == "loss normalised per call"
    assert cause.layers == ["per_call_token_mean"]
    assert "window_weights" in cause.why


def test_q1_the_users_model_optimizer_and_random_state_are_unchanged():
    model = compiled(mlp(lambda h: keras.layers.Dropout(0.3)(h)), sgd_momentum())
    model.train_on_batch(X[:32], Y[:32])  # optimizer state (moments, iterations) and a used seed
    random.seed(7)
    np.random.seed(7)
    before = {
        "model": [v.numpy().copy() for v in model.variables],  # weights and the dropout seed
        "optimizer": [v.numpy().copy() for v in model.optimizer.variables],
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
    }
    result = gacli.check_equivalence(model, X, Y, accum_steps=4, micro_batch_size=16)
    assert not result.passed  # the check trained and re-ran copies of everything
    after = [v.numpy() for v in model.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before["model"], after, strict=True))
    optimizer = [v.numpy() for v in model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before["optimizer"], optimizer, strict=True))
    assert random.getstate() == before["python"]
    assert np.array_equal(np.random.get_state()[1], before["numpy"])
    assert "within tolerance" in result.causes[-1].why


@pytest.mark.parametrize(
    "case, settings, first_words",
    [
        ("not built", {}, "the model 'sequential' is not built"),
        ("not compiled", {}, "the model 'functional"),
        ("too little data", {"micro_batch_size": 64}, "the data holds 96 samples"),
        ("tolerance zero", {"tolerance": 0}, "tolerance=0 must be a positive number"),
        ("tolerance text", {"tolerance": "small"}, "tolerance='small' must be"),
        ("tolerance nan", {"tolerance": float("nan")}, "tolerance=nan must be"),
    ],
)
def test_bad_input_is_one_paragraph_saying_what_to_give(case, settings, first_words):
    if case == "not built":
        model = keras.Sequential([keras.layers.Dense(1)], name="sequential")
        model.compile(optimizer="sgd", loss="mse")
    elif case == "not compiled":
        model = mlp()
    else:
        model = compiled(mlp())
    arguments = {"accum_steps": 4, "micro_batch_size": 16, **settings}
    with pytest.raises(EquivalenceInputError) as error:
        gacli.check_equivalence(model, X, Y, **arguments)
    message = str(error.value)
    assert message.startswith(first_words) and "\n" not in message
    assert any(word in message for word in ("e.g.", "Give", "pass", "Build", "Compile"))


def _check_output(run_dir):
    with open(os.path.join(run_dir, "equivalence.json")) as handle:
        record_ = json.load(handle)
    assert not os.path.exists(os.path.join(run_dir, "result.json"))
    assert not os.path.exists(os.path.join(run_dir, "model.keras"))
    assert not os.path.exists(os.path.join(run_dir, "checkpoints"))
    return record_


# Slow: the ga-train tests below load TensorFlow in a process each (the library's are above).
@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.parametrize(
    "optimizer, tolerance, more",
    [("adam", 1e-5, ()), ("sgd", 1e-6, ("optimizer.use_agc=true",))],
    ids=["adam", "sgd-agc"],
)
def test_ga_train_check_passes_on_the_default_job(tmp_path, optimizer, tolerance, more):
    """With SGD, adaptive gradient clipping on: the check compares the job as it trains."""
    code, output = ga_train("check=equivalence", f"optimizer={optimizer}", *more, cwd=tmp_path)
    assert code == 0, output
    saved = _check_output(run_dir_of(output))
    assert saved["passed"] and saved["tolerance"] == tolerance
    assert saved["window"] == {
        "samples": 128,
        "accum_steps": 4,
        "micro_batch_size": 32,
        "replicas": 1,
        "wrapper": "model",
        "optimizer": {"adam": "Adam", "sgd": "SGD"}[optimizer],
    }
    assert record(saved["max_abs_diff"]) <= tolerance
    assert len(saved["variables"]) == 6 and all(v["passed"] for v in saved["variables"])
    assert "EQUIVALENT: 4 micro-batches of 32 (128 samples)" in output
    assert "logits/kernel" in output  # the table


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.exactness
def test_ga_train_check_under_two_replicas_against_the_single_device_big_batch(tmp_path):
    code, output = ga_train(
        "check=equivalence",
        "strategy=mirrored",
        "strategy.logical_cpus=2",
        "micro_batch_size=16",
        "optimizer=sgd",
        cwd=tmp_path,
    )
    assert code == 0, output
    saved = _check_output(run_dir_of(output))
    assert saved["passed"] and saved["window"]["replicas"] == 2
    assert saved["window"]["samples"] == 128
    assert record(saved["max_abs_diff"]) <= 1e-6 and saved["tolerance"] == 1e-6


@pytest.mark.slow
def test_ga_train_check_fails_on_dropout_with_exit_1_and_names_it(tmp_path):
    code, output = ga_train(
        "check=equivalence",
        "model.dropout=0.3",
        "optimizer=sgd",
        "check.tolerance=1e-5",
        cwd=tmp_path,
    )
    assert code == 1, output
    saved = _check_output(run_dir_of(output))
    assert not saved["passed"] and saved["tolerance"] == 1e-5
    assert saved["tolerance_source"] == "as given"
    assert [c["kind"] for c in saved["causes"]][0] == "dropout and other random layers"
    assert "NOT EQUIVALENT" in output and "dropout" in output.lower()
    assert output.rstrip().splitlines()[-1].startswith("ga-train: NOT EQUIVALENT")


def test_ga_train_check_names_batch_norm_in_its_verdict_not_in_a_python_warning(tmp_path, capsys):
    """The cnn's batch norm in training mode: the verdict names it with the exact policies;
    gacli.BatchNormWarning, which would say it again, is not shown."""
    import re
    import warnings

    from gacli.runner.tools.equivalence_check import NotEquivalent, run_equivalence_check
    from helpers import compose_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NotEquivalent):
            run_equivalence_check(
                compose_config(
                    "model=cnn",
                    "model.filters=[4,4]",
                    "micro_batch_size=8",
                    "accum_steps=2",
                    "check=equivalence",
                ),
                str(tmp_path / "run"),
            )
    assert not [w for w in caught if issubclass(w.category, gacli.BatchNormWarning)]
    output = capsys.readouterr().out
    # Keras numbers layer names on within a process: the cnn's two are batch_normalization_<n>.
    assert re.search(r"- batch normalisation \(batch_normalization(_\d+)?, batch_norm", output)
    assert "batchnorm=freeze" in output


@pytest.mark.parametrize(
    "arguments, first_line",
    [
        (["check=equivalence", "check.tolerance=0"], "ga-train: check.tolerance=0.0 must be"),
        (["check=equivalence", "check.tolerance=-1e-6"], "ga-train: check.tolerance=-1e-06 must"),
        (["check=equivalence", "check.tolerance=nan"], "ga-train: check.tolerance=nan must be"),
        (["check=equivalence", "check.tolerance=small"], "ga-train: check.tolerance=small: check"),
        (["check.tolerance=1e-5"], "ga-train: check.tolerance is read only with check=equivalence"),
        (
            ["check=equivalence", "precision=mixed_float16"],
            "ga-train: check=equivalence with precision",
        ),
    ],
)
def test_ga_train_check_bad_input_exits_2_with_one_paragraph(tmp_path, arguments, first_line):
    code, output = ga_train(*arguments, cwd=tmp_path)
    assert code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("ga-train:")]
    assert errors and errors[0].startswith(first_line), output
    assert "Traceback" not in output


class PenalisedStep(keras.Model):
    """A functional model whose own train_step adds a penalty the compiled loss does not have."""

    def train_step(self, data):
        import tensorflow as tf

        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            loss += 0.1 * tf.add_n([tf.reduce_sum(w**2) for w in self.trainable_weights])
        gradients = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(gradients, self.trainable_weights)
        return {"loss": loss}


def test_q1_a_custom_train_step_is_named():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = PenalisedStep(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    result = gacli.check_equivalence(model, X, Y, accum_steps=4, micro_batch_size=16)
    assert not result.passed
    assert record(result.max_abs_diff) > 1e-4
    assert [cause.kind for cause in result.causes] == ["custom train_step"]
    assert result.causes[0].layers == ["PenalisedStep"]


# -- the user's own accumulation settings (every field of AccumulationConfig) ---------------------
def _sgd_check(config=None, model=None, **settings):
    model = model or compiled(mlp(), keras.optimizers.SGD(0.1))
    return gacli.check_equivalence(
        model, X, Y, micro_batch_size=16, **({"config": config} if config else {}), **settings
    )


@pytest.mark.parametrize(
    "setting, value, cause",
    [
        ("reduction", "sum", "reduction='sum'"),
        ("accumulator_dtype", "bfloat16", "accumulator_dtype='bfloat16'"),
        ("accumulator_dtype", "float16", "accumulator_dtype='float16'"),
    ],
)
def test_q1_settings_that_are_not_the_big_batch_fail_and_are_named(setting, value, cause):
    """The check runs what the user trains: a wrapped model's own settings, the accumulating
    optimizer's, or config=; each of these changes the update, and the check names it."""
    wrapped = gacli.wrap_model(mlp(), accum_steps=4, **{setting: value})
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain = mlp()
    plain.compile(
        optimizer=gacli.GradientAccumulateOptimizer(
            keras.optimizers.SGD(0.1), accum_steps=4, **{setting: value}
        ),
        loss="mse",
    )
    given = gacli.AccumulationConfig(accum_steps=4, **{setting: value})
    results = [_sgd_check(model=wrapped), _sgd_check(model=plain), _sgd_check(given)]
    for result in results:
        assert not result.passed and result.status == "NOT EQUIVALENT", str(result)
        assert record(result.max_abs_diff) > 1e-5
        assert result.settings[setting] == value
        assert [c.kind for c in result.causes] == [cause], str(result)
    assert [r.window["wrapper"] for r in results] == ["model", "optimizer", "model"]


@pytest.mark.parametrize(
    "settings",
    [
        {"use_agc": True, "clip_factor": 0.01},
        {"loss_scaling": True, "initial_scale": 2.0**10, "dynamic_growth_steps": 3},
        {"nonfinite": "skip_window"},
        {"nonfinite": "stop"},
        {"noise_scale": True, "noise_scale_every": 1, "noise_scale_decay": 0.9},
        {"accumulator_dtype": "float64"},
        {"partial_window": "carry"},
    ],
    ids=lambda settings: ",".join(settings),
)
def test_q1_settings_the_big_batch_has_pass_with_both_wrappers(settings):
    for wrapper in ("model", "optimizer"):
        config = gacli.AccumulationConfig(accum_steps=4, **settings)
        result = _sgd_check(config, wrapper=wrapper, window_samples=56)
        assert result.settings == config.to_dict()
        if wrapper == "optimizer":  # a short micro-batch: equal weights, named (below)
            assert result.causes[0].kind.startswith("optimizer wrapper"), str(result)
            continue
        assert result.passed, str(result)
        assert record(result.max_abs_diff) <= 1e-6


def test_q1_agc_is_checked_against_the_big_batch_with_agc():
    """AGC clips the window's gradient; the reference clips the big batch's. With a clip factor
    that bites, the update is smaller than without AGC, and still equal on both sides."""
    plain = _sgd_check(gacli.AccumulationConfig(accum_steps=4))
    clipped = _sgd_check(gacli.AccumulationConfig(accum_steps=4, use_agc=True, clip_factor=1e-3))
    assert clipped.passed, str(clipped)
    assert record(clipped.max_abs_diff) <= 1e-6
    assert clipped.max_update < 0.5 * plain.max_update
    assert clipped.settings["use_agc"] is True


def test_q1_window_weights_is_checked_against_the_window_weighted_big_batch():
    weights = np.random.default_rng(1).integers(0, 3, size=len(X)).astype("float32")
    config = gacli.AccumulationConfig(accum_steps=4, loss_normalization="window_weights")
    result = _sgd_check(config, sample_weight=weights, window_samples=56)
    assert result.passed, str(result)
    assert record(result.max_abs_diff) <= 1e-6
    with pytest.raises(EquivalenceInputError, match="^loss_normalization='window_weights'"):
        _sgd_check(config)
    drop = gacli.AccumulationConfig(accum_steps=4, partial_window="drop")
    with pytest.raises(EquivalenceInputError, match="^partial_window='drop' discards"):
        _sgd_check(drop, window_samples=56)
    assert _sgd_check(drop).passed  # a full window is never dropped


# -- diagnoses ------------------------------------------------------------------------------------
def test_q1_nan_inputs_are_named_as_not_finite():
    bad = X.copy()
    bad[3, 1] = np.nan
    result = gacli.check_equivalence(
        compiled(mlp(), keras.optimizers.SGD(0.1)), bad, Y, accum_steps=4, micro_batch_size=16
    )
    assert not result.passed
    assert [(c.kind, c.layers) for c in result.causes] == [
        ("inputs or loss not finite", ["inputs"])
    ]
    assert "NaN" in result.causes[0].why


def test_q1_a_loss_that_is_not_finite_is_named():
    def log_loss(y_true, y_pred):
        return keras.ops.mean(keras.ops.log(y_pred - y_pred))  # log(0): -inf

    model = compiled(mlp(), keras.optimizers.SGD(0.1), loss=log_loss)
    result = gacli.check_equivalence(model, X, Y, accum_steps=4, micro_batch_size=16)
    assert not result.passed
    assert [c.kind for c in result.causes] == ["inputs or loss not finite"], str(result)
    assert "the loss of the window is -inf" in result.causes[0].why


def test_q1_a_mixed_precision_model_is_refused_as_ga_train_refuses_it():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = compiled(mlp(), keras.optimizers.SGD(0.1))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    with pytest.raises(EquivalenceInputError) as error:
        gacli.check_equivalence(model, X, Y, accum_steps=4, micro_batch_size=16)
    message = str(error.value)
    assert message.startswith("the model 'functional") and "mixed_bfloat16" in message
    assert "ga-train check=equivalence refuses" in message and "\n" not in message


def test_q1_the_optimizer_wrappers_equal_weighting_of_a_short_micro_batch_is_named():
    result = gacli.check_equivalence(
        compiled(mlp(), keras.optimizers.SGD(0.1)),
        X,
        Y,
        accum_steps=4,
        micro_batch_size=16,
        wrapper="optimizer",
        window_samples=56,
    )
    assert not result.passed
    assert record(result.max_abs_diff) > 1e-4
    (cause,) = result.causes
    assert cause.kind == "optimizer wrapper: every micro-batch weighs the same"
    assert "8 samples counts as much as one of 16" in cause.why and "wrap_model" in cause.why


def test_q1_an_update_too_small_to_tell_is_inconclusive_not_equivalent():
    """SGD at a learning rate of 1e-8 moves no weight by 1e-6 (the tolerance): even no update
    at all would pass. Adam's first step moves weights by its learning rate whatever the
    gradient, so for it the window's gradient decides: a loss scaled by 1e-7 makes it tiny."""

    def tiny_mse(y_true, y_pred):
        return 1e-7 * keras.ops.mean((y_true - y_pred) ** 2)

    cases = [
        compiled(mlp(), keras.optimizers.SGD(1e-8)),
        compiled(mlp(), keras.optimizers.Adam(0.01), loss=tiny_mse),
    ]
    for model, tolerance in zip(cases, (1e-6, 1e-5)):
        result = gacli.check_equivalence(model, X, Y, accum_steps=4, micro_batch_size=16)
        assert result.status == "INCONCLUSIVE" and not result.passed and not result.conclusive
        assert not result.failing and result.tolerance == tolerance
        size = result.max_gradient_update or result.max_update
        assert record(size) < 10 * tolerance
        assert result.verdict().startswith("INCONCLUSIVE") and "larger learning rate" in str(result)
        assert result.to_dict()["status"] == "INCONCLUSIVE"
    # The same models at a usable scale are conclusive.
    assert _sgd_check(gacli.AccumulationConfig(accum_steps=4)).max_update >= 10 * 1e-6


# -- TF32 -----------------------------------------------------------------------------------------
def test_q1_tf32_is_off_for_the_check_and_put_back_after():
    import tensorflow as tf

    seen = []

    def recording_mse(y_true, y_pred):
        seen.append(tf.config.experimental.tensor_float_32_execution_enabled())
        return keras.ops.mean((y_true - y_pred) ** 2)

    before = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        for state in (True, False):
            tf.config.experimental.enable_tensor_float_32_execution(state)
            seen.clear()
            model = compiled(mlp(), keras.optimizers.SGD(0.1), loss=recording_mse)
            result = gacli.check_equivalence(model, X, Y, accum_steps=4, micro_batch_size=16)
            assert result.passed, str(result)
            assert tf.config.experimental.tensor_float_32_execution_enabled() is state
            assert seen and not any(seen)  # every trace of the loss ran with TF32 off
            assert result.tf32_disabled_for_check is state
            assert result.to_dict()["tf32_disabled_for_check"] is state
            assert ("TF32 was on" in str(result)) is state
        # Put back after an error too.
        tf.config.experimental.enable_tensor_float_32_execution(True)
        with pytest.raises(ValueError):
            gacli.check_equivalence(
                compiled(mlp(), keras.optimizers.SGD(0.1), loss="no_such_loss"),
                X,
                Y,
                accum_steps=4,
                micro_batch_size=16,
            )
        assert tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


# -- dict and list inputs, several outputs, datasets of dicts, sample weights ---------------------
def two_output_model(seed=0):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((FEATURES,), name="tokens")
    extra = keras.Input((2,), name="extra")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([tokens, extra]))
    score = keras.layers.Dense(1, name="score")(hidden)
    label = keras.layers.Dense(3, activation="softmax", name="label")(hidden)
    model = keras.Model({"tokens": tokens, "extra": extra}, {"score": score, "label": label})
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss={"score": "mse", "label": "sparse_categorical_crossentropy"},
        loss_weights={"score": 0.3, "label": 2.0},
    )
    return model


def two_output_data(samples=96, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "tokens": rng.normal(size=(samples, FEATURES)).astype("float32"),
        "extra": rng.normal(size=(samples, 2)).astype("float32"),
    }
    y = {
        "score": rng.normal(size=(samples, 1)).astype("float32"),
        "label": rng.integers(0, 3, size=(samples,)).astype("int32"),
    }
    return x, y, rng.uniform(0.5, 2.0, size=samples).astype("float32")


@pytest.mark.exactness
def test_q1_dict_inputs_two_outputs_loss_weights_and_sample_weights():
    import tensorflow as tf

    x, y, weights = two_output_data()
    results = [
        gacli.check_equivalence(
            two_output_model(), x, y, accum_steps=4, micro_batch_size=16, wrapper=wrapper
        )
        for wrapper in ("model", "optimizer")
    ]
    results.append(
        gacli.check_equivalence(
            two_output_model(), x, y, accum_steps=4, micro_batch_size=16, sample_weight=weights
        )
    )
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(10)
    results.append(
        gacli.check_equivalence(
            two_output_model(), dataset, accum_steps=4, micro_batch_size=16, window_samples=56
        )
    )
    for result in results:
        assert result.passed, str(result)
        assert record(result.max_abs_diff) <= 1e-6
        assert {v.layer for v in result.variables} >= {"score", "label"}
    # loss_weights reach both sides: without them the update is another one.
    unweighted = two_output_model()
    unweighted.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=unweighted.loss)
    other = gacli.check_equivalence(unweighted, x, y, accum_steps=4, micro_batch_size=16)
    assert other.passed
    assert abs(other.max_update - results[0].max_update) > 1e-3
    # A loss per output normalised per call is still measured (a gap appears under
    # sample weights only when the loss ignores them: not here, so no cause is invented).


@pytest.mark.exactness
def test_q1_list_inputs():
    keras.utils.set_random_seed(0)
    first, second = keras.Input((FEATURES,)), keras.Input((3,))
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([first, second]))
    model = keras.Model([first, second], keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    extra = np.random.default_rng(2).normal(size=(len(X), 3)).astype("float32")
    result = gacli.check_equivalence(model, [X, extra], Y, accum_steps=4, micro_batch_size=16)
    assert result.passed, str(result)
    assert record(result.max_abs_diff) <= 1e-5


def test_q1_a_tiny_keras_hub_backbone():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=6,
        dropout=0.0,
    )
    inputs = backbone.input
    model = keras.Model(inputs, keras.layers.Dense(1)(backbone(inputs)["pooled_output"]))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 50, size=(32, 6)).astype("int32"),
        "segment_ids": np.zeros((32, 6), "int32"),
        "padding_mask": np.ones((32, 6), "int32"),
    }
    y = rng.normal(size=(32, 1)).astype("float32")
    result = gacli.check_equivalence(model, x, y, accum_steps=4, micro_batch_size=8)
    assert result.passed, str(result)
    assert record(result.max_abs_diff) <= 1e-6


def test_q1_a_keras_hub_task_model_with_tied_embeddings_wrapped_or_not():
    """GPT2CausalLM computes its logits with its backbone's token embedding, called again outside
    the backbone (tied weights): the check's copies keep that one layer, not two."""
    keras_hub = pytest.importorskip("keras_hub")

    def causal_lm():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=50,
            num_layers=1,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=16,
            dropout=0.0,
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, size=(32, 8)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    y = np.roll(tokens, -1, axis=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for model in (causal_lm(), gacli.wrap_model(causal_lm(), accum_steps=4)):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        result = gacli.check_equivalence(model, x, y, accum_steps=4, micro_batch_size=8)
        assert result.passed and result.conclusive, str(result)
        # One embedding matrix, trained by both of its uses, as in the model itself.
        assert len(result.variables) == len(model.weights) == 20
        assert record(result.max_abs_diff) <= 1e-6


def test_a_copy_without_the_models_weights_is_refused_saying_what_to_do():
    """A layer whose get_config() leaves out what shapes its weights cannot be copied: the check
    names the weight and the shapes, and says what to give the layer."""

    class Projection(keras.layers.Layer):
        def __init__(self, units=3, **kwargs):
            super().__init__(**kwargs)
            self.units = units

        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")

        def call(self, inputs):
            return inputs @ self.kernel

        def get_config(self):
            return super().get_config()  # units left out

    inputs = keras.Input((FEATURES,))
    model = compiled(keras.Model(inputs, Projection(5, name="projection")(inputs)))
    with pytest.raises(EquivalenceInputError) as error:
        gacli.check_equivalence(model, X, np.zeros((len(X), 5)), accum_steps=2, micro_batch_size=8)
    message = str(error.value)
    assert "\n" not in message
    assert f"projection/kernel is ({FEATURES}, 3) in the copy, ({FEATURES}, 5) in the model" in (
        message
    )
    assert "get_config() that returns every argument of its __init__" in message
