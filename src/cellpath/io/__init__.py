"""Reading and writing the project's files: where they live (:mod:`cellpath.io.layout`)."""
