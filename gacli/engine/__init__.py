"""The accumulation engine: everything ``import gacli`` gives a Keras user.

Keras and TensorFlow only: nothing here imports Hydra, OmegaConf, :mod:`gacli.runner` or
:mod:`gacli.report` (``tests/project/test_packaging.py`` checks it). ``docs/engine.md`` says where
each part lives; the public names are re-exported by ``gacli`` itself.
"""
