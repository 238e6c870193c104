"""Host KV cache: the page pool in host memory, its prefix index, eviction policy and page-copy kernel."""
