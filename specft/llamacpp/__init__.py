"""llama.cpp beside specft: its install (scripts/install_llamacpp.sh), its server for
checks and benchmarks, its converter for GGUF exports, and a probe of its own numbers."""
