"""Models the user brings with a loss of their own: a ``compute_loss`` override is what plain
Keras trains on (its ``train_step`` calls ``self.compute_loss``), so the model wrappers must train
on it too, to the big batch's weights (contract E1), and the equivalence check must check it."""

import keras
import numpy as np
import pytest

import gacli
from gacli.engine.accumulate_model import AccumulatingModelWrapper
from gacli.engine.equivalence import EquivalenceInputError
from helpers import FEATURES, make_data, record, weights_difference

X, Y = make_data(64)
MICRO, K = 8, 4  # two windows of 32 samples


class DoubledLoss(keras.Model):
    """A model whose loss is twice Keras' compiled loss (a user's weighting, say)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return 2.0 * super().compute_loss(x, y, y_pred, sample_weight, training=training)


@keras.saving.register_keras_serializable(package="test_user_models")
class SubclassedDoubled(keras.Model):
    """The same, as a subclassed model (no symbolic inputs)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        # A loss of its own besides the compiled one: an L1 penalty on the outputs.
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return 2.0 * loss + 0.1 * keras.ops.mean(keras.ops.abs(y_pred))


class GradientAccumulateDoubled(gacli.GradientAccumulateModel):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return 2.0 * super().compute_loss(x, y, y_pred, sample_weight, training=training)


def functional(cls=DoubledLoss, seed=0, **settings):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs))
    return cls(inputs=inputs, outputs=outputs, **settings)


def subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    model = SubclassedDoubled()
    model(X[:1])
    return model


def big_batch(model):
    """The user's model itself, trained by plain Keras on windows of MICRO x K samples."""
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    for first in range(0, len(X), MICRO * K):
        model.train_on_batch(X[first : first + MICRO * K], Y[first : first + MICRO * K])
    return model.get_weights()


def accumulated(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(X, Y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.exactness
@pytest.mark.parametrize("make", [functional, subclassed], ids=["functional", "subclassed"])
def test_wrap_model_trains_on_the_models_own_compute_loss(make):
    reference = big_batch(make())
    wrapped = gacli.wrap_model(make(), accum_steps=K)
    assert isinstance(wrapped, AccumulatingModelWrapper)
    assert wrapped.count_params() == make().count_params()
    assert record(weights_difference(reference, accumulated(wrapped))) <= 1e-6
    # Keras' compiled loss alone is another training: the override is what made the difference.
    ignored = gacli.wrap_model(make(), accum_steps=K)
    ignored.compute_loss = lambda *a, **k: keras.Model.compute_loss(ignored, *a, **k)
    assert weights_difference(reference, accumulated(ignored)) > 1e-3


@pytest.mark.exactness
def test_a_gradient_accumulate_model_subclass_trains_on_its_compute_loss():
    reference = big_batch(functional())
    model = functional(GradientAccumulateDoubled, accum_steps=K)
    assert record(weights_difference(reference, accumulated(model))) <= 1e-6


def test_evaluate_reports_the_models_own_loss():
    model = functional()
    model.compile(optimizer="sgd", loss="mse")
    wrapped = gacli.wrap_model(functional(), accum_steps=K)
    wrapped.compile(optimizer="sgd", loss="mse")
    assert wrapped.evaluate(X, Y, verbose=0) == pytest.approx(model.evaluate(X, Y, verbose=0))
    plain = functional(keras.Model)
    plain.compile(optimizer="sgd", loss="mse")
    assert model.evaluate(X, Y, verbose=0) == pytest.approx(2 * plain.evaluate(X, Y, verbose=0))


def test_a_wrapped_subclassed_model_saves_and_loads_with_its_compute_loss(tmp_path):
    wrapped = gacli.wrap_model(subclassed(), accum_steps=K)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    path = str(tmp_path / "model.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.accum_steps == K and isinstance(loaded.model, SubclassedDoubled)
    assert loaded.evaluate(X, Y, verbose=0) == pytest.approx(wrapped.evaluate(X, Y, verbose=0))


@pytest.mark.exactness
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
@pytest.mark.parametrize("make", [functional, subclassed], ids=["functional", "subclassed"])
def test_check_equivalence_checks_the_models_own_compute_loss(make, wrapper):
    model = make()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    result = gacli.check_equivalence(
        model, X, Y, accum_steps=K, micro_batch_size=MICRO, wrapper=wrapper
    )
    assert result.passed, str(result)
    assert record(result.max_abs_diff) <= 1e-6
    # Through wrap_model too: the wrapper's own model is checked with its own loss.
    wrapped = gacli.wrap_model(make(), accum_steps=K)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    assert gacli.check_equivalence(wrapped, X, Y, micro_batch_size=MICRO).passed


def test_check_equivalence_refuses_a_wrapper_subclass_with_its_own_compute_loss():
    model = functional(GradientAccumulateDoubled, accum_steps=K)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(EquivalenceInputError) as error:
        gacli.check_equivalence(model, X, Y, micro_batch_size=MICRO)
    message = str(error.value)
    assert message.startswith("the model's class GradientAccumulateDoubled") and "\n" not in message
    assert "gacli.wrap_model" in message


def test_a_compute_loss_that_ignores_the_sample_weights_is_not_invented_a_cause():
    """Without an override the check of sample-weighted data passes (a guard for the above)."""
    model = functional(keras.Model)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    weights = np.linspace(0.5, 2.0, len(X)).astype("float32")
    result = gacli.check_equivalence(
        model, X, Y, accum_steps=K, micro_batch_size=MICRO, sample_weight=weights
    )
    assert result.passed, str(result)
    assert record(result.max_abs_diff) <= 1e-6
