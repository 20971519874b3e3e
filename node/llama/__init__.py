"""The llama.cpp engine: batched slots, the vocabulary and its piece boundaries, grammar
bounds and llama.cpp's log. The only package that imports ``llama_cpp``."""
