"""Reading and writing GGUF files (through the `gguf` package) and llama.cpp imatrix files."""
