"""pic inside vLLM: a KV connector (``pic.vllm.connector.PicConnector``) that serves pic's compiled chunks to
vLLM at any position, and the client helpers that build its requests (``pic.vllm.client``).

Importing this package imports nothing of vLLM's; ``pic.vllm.connector`` does (``pip install 'pic-kv[vllm]'``).
"""
