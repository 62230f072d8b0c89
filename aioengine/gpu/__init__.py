"""aioengine.gpu: the model runner (request state, flat batches, models, sampler) and backends cpu/, cuda/."""
