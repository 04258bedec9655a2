"""Benchmarks. ``python -m hf_paged bench`` runs the side-by-side suite (:mod:`.suite`); the other
modules run alone as ``python -m hf_paged.bench.<name>`` (this package imports none of them, so
running one as ``__main__`` does not import it twice)."""
