"""llamarl: staged RLHF (PPO) for Llama models.

The code lives in the repository's top-level folders, installed as sub-packages:
``llamarl.lib`` (parallel Llama), ``llamarl.stages``, ``llamarl.pipeline``, ``llamarl.cluster``.
"""

__version__ = "0.1.0"
