"""The SAE plane: sparse autoencoders as they ship (``SAE``, ``SAE.load``), the driver's named
registry, and the steering items that address their features (``Feature``, ``FeatureClamp``)."""

from steerable.sae.features import Feature, FeatureClamp
from steerable.sae.model import SAE
from steerable.sae.registry import SaeRegistry

__all__ = ["SAE", "Feature", "FeatureClamp", "SaeRegistry"]
