"""The bottom layer: types and helpers every other subpackage may import, and which import none of them.

``StepMemory`` (what one step holds), ``FinetuneMethod`` (full vs LoRA), the loss helper, the config-node
readers, the memory savers' config checks and the cache location.
"""
