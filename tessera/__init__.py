"""tessera: train transformer language models that outgrow one device."""

__version__ = "0.1.0"
