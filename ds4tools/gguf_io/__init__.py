"""Reading and writing GGUF files (through the `gguf` package) and llama.cpp imatrix files."""
from .reader import GGUFFile, TensorRef, check_header, open_gguf, split_shard_paths
from .writer import GGUFStreamWriter, MetaKey, format_bytes

__all__ = ["open_gguf", "GGUFFile", "TensorRef", "check_header", "split_shard_paths",
           "GGUFStreamWriter", "MetaKey", "format_bytes"]
