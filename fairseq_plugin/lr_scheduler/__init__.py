from . import noam  # noqa: F401
