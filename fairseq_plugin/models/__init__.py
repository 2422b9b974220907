from . import annotated_transformer, presets  # noqa: F401  (registers them)
