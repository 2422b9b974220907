from . import annotated_label_smoothing  # noqa: F401
