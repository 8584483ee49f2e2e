"""lib: the parallel Llama library every stage is built on."""
