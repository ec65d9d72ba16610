"""Host-side runtime pieces shared by the compiled backends (NVSHMEM bootstrap, ...).

Submodules are imported explicitly (``from moe_dispatcher.runtime import nvshmem``); nothing here
needs CUDA or nvshmem4py at import time.
"""
