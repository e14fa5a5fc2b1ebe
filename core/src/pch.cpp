// Translation unit that carries the precompiled LibTorch header.
