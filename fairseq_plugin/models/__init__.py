from . import annotated_transformer  # noqa: F401
