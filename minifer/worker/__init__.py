"""The worker (vLLM's ``v1/worker``): the model runner that turns a scheduled batch into tensors and a forward."""
