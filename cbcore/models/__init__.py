"""Loading models: any HF directory or hub id, and the embedded SmolLM2 default.

``ModelLoadError`` lives here so that the loader and the default model can both
raise it without importing each other.
"""


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says from where and why."""
