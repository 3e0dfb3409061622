"""Ready-made callbacks for training frameworks. Each submodule imports its
framework when it is imported itself, never before:

- ``hookcap.integrations.transformers.HookcapCallback``: HF ``Trainer``.
- ``hookcap.integrations.lightning.HookcapCallback``: ``lightning.pytorch``.
"""
