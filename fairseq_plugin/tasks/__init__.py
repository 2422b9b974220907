from . import annotated_translation  # noqa: F401
