"""Benchmarks. ``python -m hf_paged bench`` runs the side-by-side suite (:mod:`.suite`); the other
modules run alone as ``python -m hf_paged.bench.<name>`` (this package imports none of them, so
running one as ``__main__`` does not import it twice)."""

# The suite's sections after its offline comparisons, each standing alone: ``bench --skip`` leaves
# any of them out (the serving section starts a server, the tensor-parallel one two processes).
SUITE_SECTIONS = ("generate_flag_vs_stock", "prefix_generate", "serving", "tensor_parallel")
