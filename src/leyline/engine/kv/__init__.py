"""KV storage: cache layouts, token blocks, the shared prefix cache and its memory."""
