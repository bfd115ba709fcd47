"""Growing the batch while training: the growth functions a config names (``_component_:
adaptive_batching.growth.geometric``), growth from training statistics, growth periods inside an
epoch, the gradient noise scale and the LR scaling rules."""

from adaptive_batching.growth.functions import geometric, linear_ramp, step_increase
from adaptive_batching.growth.statistics import noise_scale, seesaw

__all__ = ["geometric", "linear_ramp", "noise_scale", "seesaw", "step_increase"]
