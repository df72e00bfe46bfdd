"""The command line: ``ga-train``'s entry point (cli), what the user typed checked before Hydra
composes it (user_input: the YAML file and each key), Hydra's plugins (hydra_plugins), override
parsing (overrides) and TensorFlow's start-up lines filtered from stderr (quiet_stderr).
"""
