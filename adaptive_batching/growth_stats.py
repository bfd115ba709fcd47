"""Old name of :mod:`adaptive_batching.growth.statistics`, kept so configs that name
``adaptive_batching.growth_stats.noise_scale`` or ``.seesaw`` keep working."""

from adaptive_batching.growth.statistics import noise_scale, seesaw

__all__ = ["noise_scale", "seesaw"]
