"""The SAE plane: sparse autoencoders and transcoders as they ship (``SAE.load``,
``Transcoder.load``), the driver's named registry, and the steering items that address their
features (``Feature``, ``FeatureClamp``)."""

from steerable.sae.features import Feature, FeatureClamp
from steerable.sae.model import SAE
from steerable.sae.registry import SaeRegistry
from steerable.sae.transcoder import Transcoder

__all__ = ["SAE", "Transcoder", "Feature", "FeatureClamp", "SaeRegistry"]
