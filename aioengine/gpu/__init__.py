"""aioengine.gpu: the model runner — persistent request state, flat batches, models and the sampler."""
