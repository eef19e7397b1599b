"""prefixvault: an external prefix cache that is exact for hybrid and recurrent models."""

__version__ = "0.1.0"
