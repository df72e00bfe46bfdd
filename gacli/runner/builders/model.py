"""Building the model a config's ``model`` section names: ``model=unet`` (its file's ``_target_``,
``gacli.models.unet``) and ``model._target_=my_pkg.nets.Net`` alike, by
:func:`gacli.runner.builders.targets.build`; the data fills in ``input_shape``, ``num_outputs`` and
``task`` where the target takes them."""

from gacli.runner.builders import targets
from gacli.runner.config.arguments import section_arguments


def build_model(section, input_shape, num_outputs, task):
    """The uncompiled model that ``section`` names, for data of ``input_shape`` (a tuple, or
    {input name: tuple} for data whose inputs are a dict)."""
    shape = (
        {name: tuple(dims) for name, dims in input_shape.items()}
        if isinstance(input_shape, dict)
        else tuple(input_shape)
    )
    fill = {"input_shape": shape, "num_outputs": num_outputs, "task": task}
    return targets.build("model", section_arguments(section, "model"), targets.MODEL, fill)
