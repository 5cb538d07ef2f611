"""Graph passes of the compiled path, one per file, each `(graph, ...) -> graph`."""
